"""What the tests share: real daemons started and waited for (``daemons``), multi-daemon clusters
(``cluster``), the torch oracle's comparisons (``compare``), fakes of loaderd's own interfaces
(``fakes``), the datasets test configs name (``datasets``: ``support.datasets:Squares``), the
deploy/ configs checked (``deploy_configs``) and the protocol fuzzer (``fuzzing``).

pyproject.toml puts tests/ on pytest's path, so tests import ``support.daemons`` and so on;
a daemon a test starts finds ``support.datasets`` through its config's ``python_path``.
"""

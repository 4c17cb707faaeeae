"""Framework adapters: a ``RemoteDataLoader`` inside PyTorch Lightning, HuggingFace accelerate and the
transformers ``Trainer``, giving each rank the batches the framework gives a ``DataLoader``.

One module per framework (``loaderd.integrations.lightning``, ``.accelerate``, ``.transformers``); each
imports its framework, so none is imported by ``import loaderd``. They sit above ``loaderd.loader``
(they build loaders from ``RemoteDataLoader.arguments``) and nothing below imports them. The
frameworks come with the ``integrations`` extra: ``pip install 'loaderd[integrations]'``.
"""

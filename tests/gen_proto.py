"""Regenerate (or, with --check, verify) the protobuf code in proto/loaderd/v1."""

from __future__ import annotations

import argparse
import filecmp
import sys
import tempfile
from pathlib import Path

from grpc_tools import protoc

ROOT = Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "proto"
PROTO = "loaderd/v1/loaderd.proto"
GENERATED = ("loaderd_pb2.py", "loaderd_pb2.pyi", "loaderd_pb2_grpc.py")


def generate(out_dir: Path) -> None:
    """Run protoc so that imports read `from loaderd.v1 import loaderd_pb2`."""
    include = str(Path(protoc.__file__).parent / "_proto")
    rc = protoc.main(
        [
            "protoc",
            f"-I{PROTO_DIR}",
            f"-I{include}",
            f"--python_out={out_dir}",
            f"--pyi_out={out_dir}",
            f"--grpc_python_out={out_dir}",
            PROTO,
        ]
    )
    if rc != 0:
        raise SystemExit(f"protoc failed with exit code {rc}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--check", action="store_true", help="fail if generated code is stale")
    args = parser.parse_args()
    target = PROTO_DIR / "loaderd" / "v1"
    if not args.check:
        generate(PROTO_DIR)
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        generate(Path(tmp))
        stale = [
            name
            for name in GENERATED
            if not (target / name).exists()
            or not filecmp.cmp(Path(tmp) / "loaderd" / "v1" / name, target / name, shallow=False)
        ]
    if stale:
        print(f"generated protobuf code is stale: {', '.join(stale)}; run python tests/gen_proto.py", file=sys.stderr)
        return 1
    print("generated protobuf code is up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Regenerate the Python code of every .proto under proto/ (run from the repository root).

    python tools/gen_proto.py [--out DIR]

`proto/elasticpp/rpc/<service>/v1/<name>.proto` becomes
`elasticpp/rpc/<service>/v1/<name>_pb2.py`, `_pb2_grpc.py` and `_pb2.pyi`, importable as
`elasticpp.rpc.<service>.v1.<name>_pb2`. Missing `__init__.py` files of those packages are
created. The generated code is committed; `tests/unit/test_proto_generated.py` regenerates
into a temporary directory and fails when the committed files differ.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
PROTO_ROOT = REPO / "proto"
GENERATED_SUFFIXES = ("_pb2.py", "_pb2_grpc.py", "_pb2.pyi")


def proto_files(proto_root: Path = PROTO_ROOT) -> list[Path]:
    return sorted(p.relative_to(proto_root) for p in proto_root.rglob("*.proto"))


def generate(out: Path, proto_root: Path = PROTO_ROOT) -> list[Path]:
    """Generate into `out`; returns the generated files, relative to `out`."""
    protos = proto_files(proto_root)
    if not protos:
        return []
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{proto_root}",
        f"--python_out={out}",
        f"--grpc_python_out={out}",
        f"--pyi_out={out}",
        *(str(p) for p in protos),
    ]
    subprocess.run(cmd, check=True)
    generated: list[Path] = []
    for proto in protos:
        stem = proto.with_suffix("")
        generated += [stem.with_name(stem.name + s) for s in GENERATED_SUFFIXES]
        # Every directory from the top package down must be a package to import from.
        for parent in proto.parents:
            if parent != Path("."):
                init = out / parent / "__init__.py"
                if not init.exists():
                    init.write_text("")
    return generated


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--out", type=Path, default=REPO, help="output root (default: repo)")
    args = parser.parse_args(argv)
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())

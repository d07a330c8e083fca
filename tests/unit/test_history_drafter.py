"""The history drafter: n-gram continuations from a sample's own text, its group's
siblings and earlier responses to its prompt, with bounded memory."""

import pytest

from megatron_rlhf.generation.history import HistoryDrafter, NgramIndex


def test_the_longest_match_wins_and_frequency_breaks_ties():
    index = NgramIndex(max_match=3)
    index.add([1, 2, 3, 4])
    index.add([9, 2, 3, 5])
    index.add([7, 2, 3, 5])
    assert index.next_token([2, 3]) == (5, 2 / 3, 2)  # 5 followed (2, 3) twice, 4 once
    assert index.next_token([1, 2, 3]) == (4, 1.0, 3)  # the longer match knows better
    assert index.next_token([8]) is None


def test_forgetting_a_document_restores_the_counts():
    index = NgramIndex(max_match=3)
    index.add([1, 2, 3])
    before = {k: [v[0], dict(v[1])] for k, v in index.table.items()}
    index.add([4, 1, 2, 5], start=1)
    index.add([4, 1, 2, 5], start=1, sign=-1)
    assert {k: [v[0], dict(v[1])] for k, v in index.table.items()} == before


def test_a_response_that_repeats_its_prompt_is_drafted_from_it():
    drafter = HistoryDrafter(max_match=4)
    prompt = [10, 11, 12, 13, 14, 15, 16, 17]
    drafter.begin(0, prompt)
    drafter.extend(0, [3, 12, 13])  # the response starts quoting the prompt
    assert drafter.propose(0, 4) == [14, 15, 16, 17]


def test_siblings_and_earlier_responses_are_drafted_from():
    drafter = HistoryDrafter(max_match=4)
    prompt = [1, 2, 3]
    drafter.begin(0, prompt)
    drafter.extend(0, [20, 21, 22, 23, 24])
    drafter.begin(1, prompt)  # a sibling, still generating
    drafter.extend(1, [20])
    assert drafter.propose(1, 3) == [21, 22, 23]
    drafter.finish(0)
    drafter.finish(1)
    drafter.begin(7, prompt)  # the same prompt, next epoch
    drafter.extend(7, [20, 21])
    assert drafter.propose(7, 2) == [22, 23]


def test_no_match_and_low_confidence_draft_nothing():
    drafter = HistoryDrafter(max_match=2, min_confidence=0.6)
    drafter.begin(0, [1, 2, 3])
    drafter.extend(0, [9])
    assert drafter.propose(0, 4) == []  # 9 never occurred before
    drafter.begin(1, [5, 6, 5, 7, 5, 8])
    drafter.extend(1, [5])  # 5 was followed by 6, 7 and 8 once each: 1/3 < 0.6
    assert drafter.propose(1, 4) == []


def test_history_is_bounded_per_prompt_and_in_prompts():
    drafter = HistoryDrafter(max_match=2, max_responses=2, max_prompts=2)
    for epoch in range(4):
        drafter.begin(epoch, [1, 2])
        drafter.extend(epoch, [30 + epoch, 40 + epoch])
        drafter.finish(epoch)
    assert drafter.stats()["responses"] == 2
    drafter.begin(10, [1, 2])
    drafter.extend(10, [30])  # the oldest responses are forgotten
    assert drafter.propose(10, 1) == []
    drafter.extend(10, [33])
    assert drafter.propose(10, 1) == [43]
    drafter.finish(10)
    for p in range(3):
        drafter.begin(100 + p, [50 + p])
        drafter.finish(100 + p)
    assert drafter.stats()["prompts"] == 2


def test_the_global_index_drafts_what_answers_to_other_prompts_share():
    """Answers to two prompts end alike ([7, 8, 9, 60, 61, 62]); a third prompt's answer
    reaching [7, 8, 9] is drafted from them, a match of 3 tokens; a 2-token match (below
    ``global_min_match``) and a drafter without the global index draft nothing. The index
    keeps the newest ``global_responses`` responses and forgets what the oldest added."""
    def run(drafter):
        for sid, prompt in ((0, [1, 2]), (1, [3, 4])):
            drafter.begin(sid, prompt)
            drafter.extend(sid, [50 + sid, 7, 8, 9, 60, 61, 62])
            drafter.finish(sid)
        drafter.begin(5, [90, 91])
        return drafter

    glob = run(HistoryDrafter(max_match=4, global_responses=2))
    glob.extend(5, [8, 9])
    assert glob.propose(5, 3) == []  # [8, 9]: 2 tokens, below the minimum of 3
    glob.extend(5, [7, 8, 9])
    assert glob.propose(5, 3) == [60, 61, 62]
    plain = run(HistoryDrafter(max_match=4))
    plain.extend(5, [7, 8, 9])
    assert plain.propose(5, 3) == [] and plain.stats()["global_responses"] == 0
    for sid in (6, 7):  # two newer responses push both earlier ones out of the global index
        glob.begin(sid, [40 + sid])
        glob.extend(sid, [1, 1, 1])
        glob.finish(sid)
    assert glob.stats()["global_responses"] == 2
    assert glob.propose(5, 3) == [7, 8, 9]  # its own text now: after [8, 9] came 7
    glob.finish(5)  # its answer [8, 9, 7, 8, 9] joins the global index, pushing out sample 6's
    glob.begin(9, [99])
    glob.extend(9, [9, 7, 8])
    assert glob.propose(9, 1) == [9] and glob.stats()["global_responses"] == 2


def test_bad_bounds_are_refused():
    with pytest.raises(ValueError, match="max_responses"):
        HistoryDrafter(max_responses=0)
    with pytest.raises(ValueError, match="min_confidence"):
        HistoryDrafter(min_confidence=1.5)
    with pytest.raises(ValueError, match="global_responses"):
        HistoryDrafter(global_responses=-1)


def test_what_a_sample_has_left_is_predicted_from_earlier_lengths():
    """Remaining tokens: the mean excess of the prompt's earlier responses that ran longer
    than the sample has (10 and 30 tokens: at 4 emitted, 16 left; at 12, only the 30 ran
    longer: 18); past all of them the newest responses to any prompt; past those too, as
    long again as it ran; never more than the budget left."""
    drafter = HistoryDrafter()
    prompt, other = [1, 2, 3], [7, 8]
    for sid, n in ((0, 10), (1, 30)):
        drafter.begin(sid, prompt)
        drafter.finish(sid, [5] * n)
    drafter.begin(2, other)
    drafter.finish(2, [6] * 50)
    drafter.begin(3, prompt)
    drafter.extend(3, [5] * 4)
    assert drafter.remaining(3, 100) == 16
    drafter.extend(3, [5] * 8)
    assert drafter.remaining(3, 100) == 18
    assert drafter.remaining(3, 10) == 10  # the budget left
    drafter.extend(3, [5] * 28)  # 40 emitted: longer than the prompt's, not the 50 of another
    assert drafter.remaining(3, 100) == 10
    drafter.extend(3, [5] * 20)  # 60: longer than every response known
    assert drafter.remaining(3, 100) == 60
    fresh = HistoryDrafter()
    fresh.begin(0, [9, 9])  # nothing known, nothing emitted: one token
    assert fresh.remaining(0, 100) == 1


def test_a_response_finished_elsewhere_joins_whole():
    """A sample that migrated away was seen here only in part: its whole response joins
    the history when it comes back (drafts and lengths count all of it); one that does not
    continue what the history holds is refused."""
    drafter = HistoryDrafter(max_match=2)
    drafter.begin(0, [1, 2])
    drafter.extend(0, [3, 4])  # all this rank saw before the sample migrated
    drafter.finish(0, [3, 4, 5, 6, 7])
    assert drafter.prompts[(1, 2)].responses[-1] == [1, 2, 3, 4, 5, 6, 7]
    assert list(drafter.lengths) == [5]
    drafter.begin(1, [1, 2])
    drafter.extend(1, [3, 4, 5])
    assert drafter.propose(1, 2) == [6, 7]
    drafter.begin(2, [1, 2])
    drafter.extend(2, [3, 9])  # held from an earlier stay, not how the sample went on
    drafter.finish(2, [3, 4, 5])
    assert drafter.prompts[(1, 2)].responses[-1] == [1, 2, 3, 4, 5]
    assert drafter.prompts[(1, 2)].index.next_token([3])[0] == 4  # (3, 9) forgotten


def test_a_sample_back_from_elsewhere_and_one_left_behind_are_forgotten():
    """A sample that comes back to a rank it left starts anew (what was held of it is
    forgotten, not counted twice); live samples a rollout leaves behind (finished on
    another rank) are dropped with all they added."""
    drafter = HistoryDrafter(max_match=2)
    drafter.begin(0, [1, 2])
    before = {k: [v[0], dict(v[1])] for k, v in drafter.prompts[(1, 2)].index.table.items()}
    drafter.extend(0, [3, 4])
    drafter.begin(0, [1, 2], [3, 4, 5])
    assert drafter.emitted(0) == 3
    assert drafter.prompts[(1, 2)].index.table[(3,)] == [1, {4: 1}]
    drafter.drop_live()
    assert drafter.emitted(0) is None and not drafter.live
    assert {k: [v[0], dict(v[1])] for k, v in drafter.prompts[(1, 2)].index.table.items()} == before

"""``python -m megatron_rlhf.train``: bad input is reported before any collective starts."""

import json

import pytest

import rlhf_fixtures as F

# (name, extra flags or a callable(files) -> flags, launch world size, expected message)
CASES = [
    ("batch_not_divisible_by_micro_batch",
     dict(global_batch_size=3, rollout_n=2, micro_batch_size=4), 1,
     "--global-batch-size 3 x --rollout-n 2 = 6 samples per iteration is not divisible by "
     "--micro-batch-size 4 x 1 data-parallel ranks x --num-mini-batches 1 = 4"),
    ("batch_not_divisible_by_dp",
     dict(global_batch_size=3, rollout_n=2, micro_batch_size=1), 2,
     "--global-batch-size 3 prompts must split evenly over 2 data-parallel ranks"),
    ("samples_not_divisible_by_dp_micro_batches",
     dict(global_batch_size=2, rollout_n=2, micro_batch_size=4), 2,
     "= 4 samples per iteration is not divisible by --micro-batch-size 4 x 2 data-parallel "
     "ranks"),
    ("unknown_reward",
     dict(reward_fn="nope"), 1,
     "unknown reward function 'nope'; valid names: concise, format_bullets, math, no_e, token_parity"),
    ("missing_user_reward",
     dict(reward_fn="rlhf_fixtures:no_such_function"), 1,
     "cannot load reward function 'rlhf_fixtures:no_such_function'"),
    ("prompt_too_long",
     lambda f: dict(prompts=f["long_prompts"], max_prompt_length=8), 1,
     "prompt line5 has 20 tokens, more than --max-prompt-length 8"),
    ("sequence_beyond_positions",
     dict(max_prompt_length=40, max_new_tokens=30), 1,
     "--max-prompt-length 40 + --max-new-tokens 30 (+1 for verification) = 71 exceeds the "
     "actor's 64 positions"),
    ("resume_from_empty_dir",
     lambda f: dict(load=f["empty"]), 1,
     "holds no training checkpoint (latest_checkpointed_iteration.txt is missing)"),
    ("grpo_single_rollout",
     dict(advantage_estimator="grpo", rollout_n=1), 1,
     "grpo compares the responses to one prompt: use --rollout-n >= 2"),
    ("fewer_prompts_than_batch",
     dict(global_batch_size=32, rollout_n=1, micro_batch_size=4), 1,
     "16 prompts are fewer than --global-batch-size 32"),
    ("missing_prompts_file",
     lambda f: dict(prompts=f["empty"] / "nothing.jsonl"), 1,
     "nothing.jsonl"),
    ("no_chat_template",
     dict(no_chat=None), 1,
     "the tokenizer has no chat template: encode prompts as plain text (generate: drop --chat; train: --no-chat)"),
    ("missing_actor",
     lambda f: dict(actor_load=f["empty"] / "nothing"), 1,
     "does not exist"),
    ("rollout_is_cap_without_a_training_forward",
     dict(rollout_is_cap=2.0, no_recompute_logprobs=True), 1,
     "--rollout-is-cap 2.0 weighs each token by the training forward's log pi_old against the "
     "generator's: add --recompute-logprobs"),
    ("routing_replay_of_a_dense_actor",
     dict(routing_replay="rollout"), 1,
     "--routing-replay acts on the routers of a mixture of experts; the actor"),
    ("frozen_router_of_a_dense_actor",
     dict(moe_freeze_router=True), 1,
     "--moe-freeze-router acts on the routers of a mixture of experts; the actor"),
    ("expert_parallel_generation",
     dict(gen_layout="1x2:ep2"), 2,
     "--gen-layout 1x2:ep2: generation decodes each data-parallel rank's samples on its own"),
    ("train_layout_not_the_world",
     dict(train_layout="2x1x2"), 2,
     "--train-layout 2x1x2 needs ranks 0..3, the world has 0..1: TP x PP x DP must fit it"),
    ("train_layout_on_part_of_the_world_without_a_gen_layout",
     dict(train_layout="1x1x1@1"), 2,
     "--train-layout 1x1x1@1 covers 1 of the world's 2 ranks: give --gen-layout TPxDP over all of them"),
    ("gen_layout_not_the_world",
     dict(gen_layout="1x4"), 2,
     "--gen-layout 1x4 covers 4 ranks, the world has 2: TP x DP must equal it (e.g. --gen-layout 1x2)"),
    ("gen_layout_tp_beyond_kv_heads",
     dict(gen_layout="4x1", global_batch_size=4, micro_batch_size=1), 4,
     "in the gen layout: tensor parallel size 4 must divide 2 KV heads"),
    ("gen_layout_dp_and_batch",
     dict(gen_layout="1x4", train_layout="4x1x1", global_batch_size=6, rollout_n=2, micro_batch_size=1), 4,
     "--global-batch-size 6 prompts must split evenly over the generation layout's 4 data-parallel ranks"),
    ("layers_not_divisible_by_pp",
     dict(train_layout="1x3x1", global_batch_size=3, micro_batch_size=1, rollout_n=2), 3,
     "in the train layout: pipeline parallel size 3 must divide 2 layers; sizes that work for this model: [1, 2]"),
    ("ref_layout_beyond_the_world",
     dict(ref_layout="1x1x2@1"), 2,
     "--ref-layout 1x1x2@1 needs ranks 1..2, the world has 0..1: fewer ranks or a lower @FIRST_RANK"),
    ("draft_train_layout_on_part_of_the_world",
     lambda f: dict(draft_train_layout="train", train_layout="1x1x1", gen_layout="1x2",
                    draft_load=f["actor"], draft_distill=True, num_draft_tokens=2), 2,
     "--draft-train-layout train needs a train layout over all 2 ranks (it covers 1): use "
     "--draft-train-layout gen"),
    ("reward_layout_without_a_reward_model",
     dict(reward_layout="1x1x2"), 2,
     "--reward-layout places a model this run does not have (the reward): drop it"),
    ("critic_layout_tp_beyond_kv_heads",
     dict(critic_layout="4x1x1", advantage_estimator="gae", global_batch_size=4, micro_batch_size=1), 4,
     "in the critic layout: tensor parallel size 4 must divide 2 KV heads"),
    ("critic_infer_layout_without_a_critic",
     dict(critic_infer_layout="1x1x2", advantage_estimator="grpo", rollout_n=2), 2,
     "--critic-infer-layout places a model this run does not have (the critic): drop it"),
    ("critic_infer_layout_tp_beyond_kv_heads",
     dict(critic_infer_layout="4x1x1", advantage_estimator="gae", global_batch_size=4, micro_batch_size=1), 4,
     "in the critic inference layout: tensor parallel size 4 must divide 2 KV heads"),
    ("draft_train_layout_without_distillation",
     dict(draft_train_layout="train"), 2,
     "--draft-train-layout train places the draft's distillation: it needs --draft-distill"),
    ("draft_train_layout_pipelined",
     lambda f: dict(draft_train_layout="train", train_layout="1x2x1", draft_load=f["actor"],
                    draft_distill=True, num_draft_tokens=2), 2,
     "--draft-train-layout train needs a train layout without pipeline stages (it has PP=2)"),
    ("layout_form",
     dict(gen_layout="1x1x2"), 2,
     "layout '1x1x2' is not of the form TPxDP, e.g. 1x8"),
    ("layout_contradicts_tp",
     dict(train_layout="1x1x2", tensor_model_parallel_size=2), 2,
     "--tensor-model-parallel-size 2 contradicts --train-layout 1x1x2"),
    ("plan_and_layouts",
     dict(plan="auto", gen_layout="1x2"), 2,
     "--plan sets the layouts: drop the --*-layout flags, or --plan"),
    ("plan_file_missing",
     lambda f: dict(plan=f["empty"] / "plan.json"), 2,
     "plan.json does not exist (write one with tools/plan.py --out FILE)"),
    ("plan_not_executable",
     lambda f: dict(plan=f["plans"]["actor_apart"]), 2,
     "the plan puts actor_train on 2x1x1 and actor_inf on 1x1x2: this trainer runs every call "
     "but generation on one layout"),
    ("math_without_answers",
     dict(reward_fn="math"), 1,
     "prompts.jsonl, line 1: missing the 'answer' field that the reward function checks answers "
     "against (--answer-key names it)"),
    ("prompt_key_missing",
     dict(prompt_key="question"), 1, "prompts.jsonl, line 1: missing the 'question' field"),
    ("k1_as_grpo_loss",
     dict(advantage_estimator="grpo", kl_estimator="k1"), 1,
     "--kl-estimator k1 cannot be the KL loss of grpo: its expected gradient is zero"),
    ("filter_groups_with_a_gen_layout",
     dict(advantage_estimator="grpo", filter_groups=True, train_layout="2x1x1", gen_layout="1x2"), 2,
     "--filter-groups keeps each group on the rank that generated it"),
    ("overlong_buffer_past_the_limit",
     dict(advantage_estimator="grpo", overlong_buffer=7), 1,
     "--overlong-buffer 7 exceeds --max-new-tokens 6: the penalty would start before the first token"),
    ("dr_grpo_needs_grpo",
     dict(no_grpo_std_norm=True), 1,
     "--no-grpo-std-norm changes grpo's advantages; the advantage estimator is gae"),
    ("eval_needs_a_reward_fn",
     lambda f: dict(eval_prompts=f["prompts"], reward_fn=None, reward_load=f["actor"]), 1,
     "--eval-prompts scores the held-out responses with the run's reward function"),
    ("eval_file_missing",
     lambda f: dict(eval_prompts=f["empty"] / "nope.jsonl"), 1, "nope.jsonl: no such prompts file"),
    ("eval_samples_greedy",
     lambda f: dict(eval_prompts=f["prompts"], eval_samples=4), 1,
     "--eval-samples 4 greedy responses would all be the same"),
    ("distributed_timeout_not_positive",
     dict(distributed_timeout_minutes=0), 1, "--distributed-timeout-minutes: must be > 0, got 0"),
    ("valid", {}, 2, None),  # the control: good flags get as far as the first collective
    ("valid_plan", lambda f: dict(plan=f["plans"]["ok"]), 2, None),
    ("valid_plan_reference_apart", lambda f: dict(plan=f["plans"]["ref_apart"]), 2, None),
    ("valid_plan_critic_split", lambda f: dict(plan=f["plans"]["critic_split"], advantage_estimator="gae"), 2, None),
    ("valid_layouts", dict(train_layout="2x1x1", gen_layout="1x2"), 2, None),
    ("valid_reference_on_part_of_the_world", dict(ref_layout="1x1x1@1"), 2, None),
    ("valid_pipeline", dict(train_layout="1x2x1"), 2, None),
    ("valid_verifiable", lambda f: dict(eval_prompts=f["prompts"], eval_samples=2, eval_temperature=1.0,
                                        advantage_estimator="grpo", filter_groups=True,
                                        clip_eps_high=0.28, dual_clip=3.0, overlong_buffer=2,
                                        loss_agg="seq-mean-token-sum-norm"), 2, None),
    ("valid_dr_grpo", dict(advantage_estimator="grpo", no_grpo_std_norm=True, overlong_buffer=6,
                           loss_agg="seq-mean-token-sum"), 2, None),
]


@pytest.fixture(scope="module")
def results(world1, tmp_path_factory):
    """Every case of CASES, validated in one bombed process."""
    d = tmp_path_factory.mktemp("train_cli")
    actor = F.make_actor_checkpoint(d / "actor", world1)
    prompts = F.write_prompts(d / "prompts.jsonl")
    long = list(F.PROMPTS)
    long[4] = "abcdefghijklmnopqrst"  # line 5: 20 tokens
    files = {"long_prompts": F.write_prompts(d / "long.jsonl", long), "empty": d / "empty", "actor": actor,
             "prompts": prompts}
    files["empty"].mkdir()
    files["plans"] = {}
    for name, ref, critic, extra in (("ok", "2x1x1", "2x1x1", {}), ("ref_apart", "1x1x2", "2x1x1", {}),
                                     ("critic_split", "2x1x1", "1x1x2", {}),  # a second critic copy
                                     ("actor_apart", "2x1x1", "2x1x1", {"actor_inf": "1x1x2"})):
        layouts = {"actor_gen": "1x2", "ref_inf": ref, "critic_inf": critic,
                   "actor_train": "2x1x1", "critic_train": "2x1x1", **extra}
        files["plans"][name] = d / f"{name}.json"
        files["plans"][name].write_text(json.dumps({"layouts": layouts}))
    cases = []
    for _, extra, world, _ in CASES:
        flags = extra(files) if callable(extra) else extra
        cases.append((F.train_args(actor, prompts, d / "out", **flags), world))
    return dict(zip([c[0] for c in CASES], F.run_validation(cases)))


@pytest.mark.parametrize("name,extra,world,message", CASES, ids=[c[0] for c in CASES])
def test_bad_input_fails_before_collectives(results, name, extra, world, message):
    r = results[name]
    if message is None:
        assert r["code"] == "BOMB: init_process_group reached" and not r["output"], r
        return
    assert "BOMB" not in str(r["code"]) + r["output"], f"{name} reached a collective: {r}"
    assert r["code"] == 2, r
    assert "error: " in r["output"], r["output"]
    assert message in r["output"], r["output"]
    assert "Traceback" not in r["output"]

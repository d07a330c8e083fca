"""The reward of the behaviour runs: token parity, and every scored sample appended to a file.

``--reward-fn behaviour_reward:parity_recorded`` with ``BEHAVIOUR_SAMPLES=DIR``: each process
appends one JSON line per sample to ``DIR/<pid>.jsonl``, so the harness can hash the samples.
"""

import json
import os


def parity_recorded(sample) -> float:
    path = os.path.join(os.environ["BEHAVIOUR_SAMPLES"], f"{os.getpid()}.jsonl")
    with open(path, "a") as f:
        f.write(json.dumps({"prompt": sample.prompt, "response_ids": list(sample.response_ids),
                            "finish": sample.finish_reason}) + "\n")
    return float(len(sample.response_ids) % 2)

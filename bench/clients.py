"""Real clients against a real stack: guidellm on both OpenAI endpoints, and
lm-eval-harness's local-completions model against its own hf model on the same
weights.

guidellm and lm-eval pull in hundreds of MB (datasets, pandas, scikit-learn,
sanic, ...), too much for every CI run, so they live in their own virtualenv
(`make evals` builds it: .venv-evals, with the same pinned CPU torch) and this
script runs their command lines, as a user would. The stack serves the
`synthetic` weights saved to a directory, which lm-eval's hf model loads too.

    python -m bench.clients            # after `make evals` has built .venv-evals
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.report import RESULTS, write_json
from bench.stack import REPO_ROOT, running_stack, stack_env

OUT = RESULTS / "clients.json"
# Nothing here may reach the hub: the model, its tokenizer and the task are local.
OFFLINE = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}
ENDPOINTS = ("/v1/completions", "/v1/chat/completions")
GUIDELLM_OUTCOMES = ("successful", "errored", "incomplete")
# A tiny loglikelihood task in a local JSON file: lm-eval never touches the hub.
TASK_DOCS = [
    {"context": "The capital of France is", "continuation": " Paris"},
    {"context": "One, two, three,", "continuation": " four, five"},
    {"context": "Water boils at 100 degrees", "continuation": " Celsius at sea level."},
    {"context": "def add(a, b):\n   ", "continuation": " return a + b"},
    {"context": "Roses are red,", "continuation": " violets are blue"},
    {"context": "Q: What is 2 + 2?\nA:", "continuation": " 4"},
]
TASK_YAML = """\
task: tiny_loglikelihood
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{context}}}}"
doc_to_target: "{{{{continuation}}}}"
metric_list:
  - metric: perplexity
    aggregation: perplexity
    higher_is_better: false
"""


def save_synthetic(directory: Path) -> None:
    """The `synthetic` model and its tokenizer, as a local model directory."""
    code = (
        "import sys\n"
        "from transformers import PreTrainedTokenizerFast\n"
        "from worker.model.loader import gpt2_tokenizer, synthetic_model\n"
        "synthetic_model().model.save_pretrained(sys.argv[1])\n"
        "eot = '<|endoftext|>'\n"
        "PreTrainedTokenizerFast(tokenizer_object=gpt2_tokenizer(), bos_token=eot,\n"
        "    eos_token=eot, unk_token=eot).save_pretrained(sys.argv[1])\n"
    )
    subprocess.run([sys.executable, "-c", code, str(directory)], check=True, cwd=REPO_ROOT)


def run_guidellm(
    evals: Path, url: str, model_dir: Path, endpoint: str, requests: int, out: Path
) -> dict[str, Any]:
    report = out / f"guidellm{endpoint.replace('/', '_')}.json"
    command = [
        str(evals / "bin" / "guidellm"),
        "run",
        "--backend",
        f"kind=openai_http,target={url},request_format={endpoint}",
        "--profile",
        "kind=concurrent,streams=4",
        "--constraint",
        f"kind=max_requests,count={requests}",
        "--data",
        "kind=synthetic_text,prompt_tokens=64,output_tokens=16",
        "--tokenizer",
        f"kind=hf_auto,model={model_dir}",
        "--output",
        f"kind=json,path={report}",
        "--disable-progress",
    ]
    started = time.monotonic()
    subprocess.run(command, check=True, cwd=out, env=OFFLINE, stdout=subprocess.DEVNULL)
    [benchmark] = json.loads(report.read_text())["benchmarks"]
    requests_by_outcome = benchmark["requests"]  # each outcome: a list of requests
    return {
        "endpoint": endpoint,
        "command": " ".join(command[1:]),
        **{outcome: len(requests_by_outcome[outcome]) for outcome in GUIDELLM_OUTCOMES},
        "seconds": round(time.monotonic() - started, 1),
    }


def run_lm_eval(evals: Path, model: str, model_args: str, task_dir: Path, out: Path) -> list[float]:
    """The loglikelihood lm-eval computed for each doc, in doc order."""
    output = out / f"lm_eval_{model}"
    command = [
        str(evals / "bin" / "lm_eval"),
        "--model",
        model,
        "--model_args",
        model_args,
        "--tasks",
        "tiny_loglikelihood",
        "--include_path",
        str(task_dir),
        "--log_samples",
        "--output_path",
        str(output),
        "--device",
        "cpu",
    ]
    subprocess.run(command, check=True, cwd=out, env=OFFLINE, stdout=subprocess.DEVNULL)
    [samples_file] = output.rglob("samples_tiny_loglikelihood_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    samples.sort(key=lambda sample: sample["doc_id"])
    return [float(sample["resps"][0][0][0]) for sample in samples]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--evals-venv", type=Path, default=REPO_ROOT / ".venv-evals")
    parser.add_argument("--requests", type=int, default=32, help="guidellm requests per endpoint")
    args = parser.parse_args()
    evals = args.evals_venv.resolve()
    if not (evals / "bin" / "guidellm").exists() or not (evals / "bin" / "lm_eval").exists():
        sys.exit(f"{evals} has no guidellm or lm_eval: run `make evals` first")
    with tempfile.TemporaryDirectory(prefix="clients-") as tmp:
        out = Path(tmp)
        model_dir = out / "synthetic"
        save_synthetic(model_dir)
        task_dir = out / "task"
        task_dir.mkdir()
        data = task_dir / "docs.jsonl"
        data.write_text("".join(json.dumps(doc) + "\n" for doc in TASK_DOCS))
        (task_dir / "tiny_loglikelihood.yaml").write_text(TASK_YAML.format(data=data))
        env = stack_env({"MODEL_ID": str(model_dir), **OFFLINE})
        with running_stack(out / "stack", env) as stack:
            stack.wait_live(timeout_s=300)
            guidellm = [
                run_guidellm(evals, stack.url, model_dir, endpoint, args.requests, out)
                for endpoint in ENDPOINTS
            ]
            served = run_lm_eval(
                evals,
                "local-completions",
                f"model={model_dir},base_url={stack.url}/v1/completions,"
                f"tokenizer_backend=huggingface,tokenizer={model_dir},max_retries=1",
                task_dir,
                out,
            )
        reference = run_lm_eval(evals, "hf", f"pretrained={model_dir},dtype=float32", task_dir, out)
    differences = [abs(a - b) for a, b in zip(served, reference, strict=True)]
    report = {
        "guidellm": guidellm,
        "lm_eval": {
            "docs": len(TASK_DOCS),
            "local_completions": served,
            "hf": reference,
            "max_abs_difference": max(differences),
        },
    }
    write_json(OUT, report)
    for run in guidellm:
        print(f"guidellm {run['endpoint']}: {run['successful']} ok, {run['errored']} errored")
    print(f"lm-eval loglikelihoods, served vs hf: max |difference| {max(differences):.2e}")


if __name__ == "__main__":
    main()

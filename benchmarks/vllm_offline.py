"""One offline vLLM run for tests/integrations/test_vllm.py and benchmarks/bench_vllm.py, in its
own process (vLLM spawns an engine process per ``LLM`` and keeps global state; a fresh process
per engine configuration keeps runs independent and frees the memory).

``python vllm_offline.py JOB`` where JOB is a JSON object: ``model`` (a model directory),
``structured_backend`` (vLLM's ``structured_outputs_config.backend``), ``speculative`` (a vLLM
``speculative_config`` or null) and ``requests`` (a list of ``{"prompt", "max_tokens",
"structured"}``, ``structured`` holding one ``StructuredOutputsParams`` field) and optionally
``max_num_seqs`` (default 8). Prints one line
``RESULT {json}``: per request ``text``, ``token_ids``, ``finish_reason``; plus ``seconds`` (the
generate call) and ``spec`` (vLLM's speculative-decoding counters, when it ran with a drafter).
Our backend is picked by ``$SPEC_GRAMMAR_VLLM_BACKEND``, as in production.
"""

from __future__ import annotations

import json
import sys
import time

from result_job import print_result  # beside this script


def _spec_counters(llm) -> dict[str, float]:
    out: dict[str, float] = {}
    for metric in llm.get_metrics():
        if metric.name.startswith("vllm:spec_decode_num") and hasattr(metric, "value"):
            out[metric.name.removeprefix("vllm:spec_decode_")] = metric.value
    return out


def main(job: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    llm = LLM(
        job["model"],
        dtype="float32",
        max_model_len=1024,
        max_num_seqs=job.get("max_num_seqs", 8),
        enforce_eager=True,
        seed=0,
        disable_log_stats=False,
        structured_outputs_config={"backend": job["structured_backend"]},
        speculative_config=job.get("speculative"),
    )
    tok = llm.get_tokenizer()
    prompts, params = [], []
    for r in job["requests"]:
        prompts.append(
            tok.apply_chat_template(
                [{"role": "user", "content": r["prompt"]}],
                tokenize=False,
                add_generation_prompt=True,
            )
        )
        params.append(
            SamplingParams(
                temperature=0,
                max_tokens=r["max_tokens"],
                structured_outputs=StructuredOutputsParams(**r["structured"])
                if r.get("structured")
                else None,
            )
        )
    start = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    seconds = time.perf_counter() - start
    return {
        "seconds": seconds,
        "spec": _spec_counters(llm) if job.get("speculative") else None,
        "outputs": [
            {
                "text": o.outputs[0].text,
                "token_ids": list(o.outputs[0].token_ids),
                "finish_reason": o.outputs[0].finish_reason,
            }
            for o in outs
        ],
    }


if __name__ == "__main__":
    result = main(json.loads(sys.argv[1]))
    print_result(result)

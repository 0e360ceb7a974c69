"""Run one real vLLM engine (CPU wheel) on a job, in its own process, and write what it
generated. Used by the vLLM tests and ``benchmarks/bench_vllm.py``.

    python engine_run.py JOB.json OUT.json

The job (JSON): ``model_dir``; ``endpoint`` (``null``: no hicache connector);
``prompts`` (lists of token ids); ``batches`` (lists of prompt indices, generated one
batch after another); ``max_tokens`` (for every batch, or a list: one per batch);
``logprobs``; optional ``pool_name``, ``multiprocessing`` (vLLM's separate engine-core / worker processes; default true),
``gate_dir`` (before batch ``i`` wait for the file ``go-<i>`` there, and write
``done-<i>`` after it), ``repeat`` (run the batches this many times: a long-running
engine), ``reset_prefix_cache`` (empty vLLM's own prefix cache before each batch — or, given a
list, before the batches of those indices — so that hits come from hicache alone),
``update_weights`` (batch indices: before each, the weights are changed in place —
:func:`perturb_weights`, in-process engines only — and every cache reset, the
connector's included: ``reset_prefix_cache(reset_connector=True)``), ``engine`` (extra
``LLM`` keyword arguments), ``extra_config``, ``kv_role`` (the connector's: default
``kv_both``).

The output (JSON): per batch, per request: ``tokens``, ``logprobs`` (per position, the
logprob of every returned candidate, as ``[token, logprob]`` pairs), ``num_cached_tokens``,
``ttft_s`` (vLLM's first-token latency), and the batch's wall time; ``preemptions``: how
many times vLLM's scheduler preempted a request (its ``vllm:num_preemptions``);
``cached_by_source``: its prompt tokens cached, by the tier that held them (its
``vllm:prompt_tokens_cached_by_source``, the sources not 0).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path


def write_model(directory: Path, *, hidden: int = 128, heads: int = 4, kv_heads: int = 2, head_dim: int = 32,
                layers: int = 2, intermediate: int = 256, vocab: int = 1024, max_positions: int = 4096) -> Path:
    """A small Llama: ``config.json`` and ``model.safetensors`` with random weights from a
    fixed seed (every engine gets the same weights).

    Not vLLM's dummy loader: its weights are uniform in ±1e-3, so small that every
    logprob is -ln(vocab) to seven digits and the greedy tokens depend on the last prompt
    token alone — a prompt whose earlier KV was garbage generated the same tokens and
    logprobs, and no comparison with a run without hicache could catch a wrong load.
    Here each projection has unit gain (std 1/sqrt(fan-in)) and the embeddings unit
    scale, so the logprobs of every position depend on every earlier token's KV."""
    import torch
    from safetensors.torch import save_file

    directory.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": hidden,
        "num_attention_heads": heads, "num_key_value_heads": kv_heads, "head_dim": head_dim,
        "num_hidden_layers": layers, "intermediate_size": intermediate, "vocab_size": vocab,
        "max_position_embeddings": max_positions, "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
        "torch_dtype": "bfloat16", "bos_token_id": 1, "eos_token_id": 2, "tie_word_embeddings": False,
        "hidden_act": "silu",
    }
    generator = torch.Generator().manual_seed(0)

    def weight(rows: int, cols: int, std: float) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=generator) * std).to(torch.bfloat16)

    def ones() -> torch.Tensor:
        return torch.ones(hidden, dtype=torch.bfloat16)

    tensors = {"model.embed_tokens.weight": weight(vocab, hidden, 1.0), "model.norm.weight": ones(),
               "lm_head.weight": weight(vocab, hidden, hidden ** -0.5)}
    for i in range(layers):
        shapes = {"self_attn.q_proj": (heads * head_dim, hidden), "self_attn.k_proj": (kv_heads * head_dim, hidden),
                  "self_attn.v_proj": (kv_heads * head_dim, hidden), "self_attn.o_proj": (hidden, heads * head_dim),
                  "mlp.gate_proj": (intermediate, hidden), "mlp.up_proj": (intermediate, hidden),
                  "mlp.down_proj": (hidden, intermediate)}
        for name, (rows, cols) in shapes.items():
            tensors[f"model.layers.{i}.{name}.weight"] = weight(rows, cols, cols ** -0.5)
        tensors[f"model.layers.{i}.input_layernorm.weight"] = ones()
        tensors[f"model.layers.{i}.post_attention_layernorm.weight"] = ones()
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def perturb_weights(model) -> None:
    """A weight update as a training loop makes one, in place: noise added to the token
    embeddings (the KV of every position changes). (Not a projection's weights: vLLM's
    CPU backend computes with a packed copy of them made at load time.)"""
    import torch

    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "embed_tokens" in name:
                param.add_((torch.randn(param.shape, generator=generator) * 0.5).to(param.dtype))


def _wait_for(path: Path, timeout_s: float = 600.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.05)


def main(job_path: str, out_path: str) -> None:
    job = json.loads(Path(job_path).read_text())
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "1" if job.get("multiprocessing", True) else "0"
    os.environ.update(job.get("env", {}))
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    engine_args = dict(model=job["model_dir"], skip_tokenizer_init=True, enforce_eager=True,
                       block_size=32, max_model_len=job.get("max_model_len", 1024), enable_prefix_caching=True,
                       dtype="bfloat16", disable_log_stats=False, seed=0)
    engine_args.update(job.get("engine", {}))
    if job.get("endpoint"):
        from vllm.config import KVTransferConfig

        extra = {"hicache.endpoint": job["endpoint"], "hicache.timeout_s": job.get("timeout_s", 1.0)}
        if job.get("pool_name"):
            extra["hicache.pool_name"] = job["pool_name"]
        extra.update(job.get("extra_config", {}))
        engine_args["kv_transfer_config"] = KVTransferConfig(
            kv_connector="HicacheConnector", kv_connector_module_path="hicache.integrations.vllm",
            kv_role=job.get("kv_role", "kv_both"), kv_connector_extra_config=extra)
    started = time.monotonic()
    llm = LLM(**engine_args)
    max_tokens = job["max_tokens"]
    per_batch = max_tokens if isinstance(max_tokens, list) else [max_tokens] * len(job["batches"])
    # (ignore_eos: every request generates its max_tokens; the random weights may pick the EOS id)
    params = [SamplingParams(temperature=0, max_tokens=n, logprobs=job.get("logprobs", 2), detokenize=False,
                             ignore_eos=True)
              for n in per_batch]
    out = {"engine_start_s": time.monotonic() - started, "batches": [], "pid": os.getpid()}
    gate = Path(job["gate_dir"]) if job.get("gate_dir") else None
    prompts = job["prompts"]
    for repeat in range(job.get("repeat", 1)):
        for b, batch in enumerate(job["batches"]):
            step = repeat * len(job["batches"]) + b
            if gate is not None:
                _wait_for(gate / f"go-{step}")
            if b in job.get("update_weights", ()):
                llm.apply_model(perturb_weights)
                assert llm.reset_prefix_cache(reset_connector=True), "vLLM could not reset its caches"
            reset = job.get("reset_prefix_cache")
            if reset is True or (isinstance(reset, list) and b in reset):
                llm.reset_prefix_cache()
            t0 = time.monotonic()
            results = llm.generate([TokensPrompt(prompt_token_ids=prompts[i]) for i in batch], params[b],
                                   use_tqdm=False)
            wall = time.monotonic() - t0
            requests = []
            for i, r in zip(batch, results):
                c = r.outputs[0]
                logprobs = [sorted([int(t), float(lp.logprob)] for t, lp in pos.items()) for pos in (c.logprobs or [])]
                metrics = getattr(r, "metrics", None)
                ttft = getattr(metrics, "first_token_latency", None) if metrics is not None else None
                requests.append({"prompt": i, "tokens": list(c.token_ids), "logprobs": logprobs,
                                 "num_cached_tokens": r.num_cached_tokens or 0, "ttft_s": ttft})
            out["batches"].append({"wall_s": wall, "requests": requests})
            Path(out_path).write_text(json.dumps(out))
            if gate is not None:
                (gate / f"done-{step}").write_text("")
    metrics = llm.get_metrics()
    out["preemptions"] = sum(int(getattr(m, "value", 0)) for m in metrics if m.name == "vllm:num_preemptions")
    out["cached_by_source"] = {}
    for m in metrics:
        if m.name == "vllm:prompt_tokens_cached_by_source" and getattr(m, "value", 0):
            source = m.labels.get("source", "")
            out["cached_by_source"][source] = out["cached_by_source"].get(source, 0) + int(m.value)
    Path(out_path).write_text(json.dumps(out))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

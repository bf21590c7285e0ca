"""`GET /metrics`: the engine's counters in the Prometheus text exposition format (version 0.0.4)."""
from __future__ import annotations

from cudflash.server.engine_loop import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def render_metrics(stats: EngineStats, speculative: bool) -> str:
    lines: list[str] = []

    def metric(name: str, kind: str, help_text: str, value: float, labels: dict[str, str] | None = None,
               header: bool = True) -> None:
        if header:
            lines.extend([f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"])
        label_text = "{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else ""
        lines.append(f"{name}{label_text} {value:g}" if isinstance(value, float) else f"{name}{label_text} {value}")

    if speculative:
        mean = stats.spec_tokens / stats.spec_steps if stats.spec_steps else 0.0
    else:
        mean = 1.0 if stats.generated_tokens else 0.0  # plain decoding commits one token per step
    metric("cudflash_requests_running", "gauge", "Requests being prefilled or decoded.", stats.running)
    metric("cudflash_requests_waiting", "gauge", "Requests queued for admission.", stats.waiting)
    metric("cudflash_kv_blocks_used", "gauge", "KV cache blocks held by requests.", stats.kv_blocks_used)
    metric("cudflash_kv_blocks_total", "gauge", "KV cache blocks in the pool.", stats.kv_blocks_total)
    metric("cudflash_prompt_tokens_total", "counter", "Prompt tokens of admitted requests.", stats.prompt_tokens)
    metric("cudflash_generated_tokens_total", "counter", "Tokens generated.", stats.generated_tokens)
    metric("cudflash_engine_steps_total", "counter", "Engine steps that produced tokens.", stats.steps)
    metric("cudflash_acceptance_length", "gauge",
           "Mean tokens committed per speculative step (accepted drafts + 1) over finished requests.", float(mean))
    metric("cudflash_preemptions_total", "counter", "Sequences preempted for lack of KV blocks.", stats.preemptions)
    metric("cudflash_prefix_cache_hit_tokens_total", "counter", "Prompt tokens served from the prefix cache.",
           stats.prefix_cache_hit_tokens)
    reasons = dict.fromkeys(("stop", "length", "abort"), 0) | stats.finished
    for i, (reason, count) in enumerate(sorted(reasons.items())):
        metric("cudflash_requests_finished_total", "counter", "Finished requests by finish reason.", count,
               {"finish_reason": reason}, header=i == 0)
    return "\n".join(lines) + "\n"

"""`mleagle generate`: offline generation with the engine in this process.

Prompts come from `--prompt` (repeatable) or a JSONL file (rows with `prompt`, or `turns` as in the
shared benchmark data: the first turn is used). All prompts run together as one continuously batched
load. Without `--json` the text streams to stdout in prompt order (the first prompt live, the others
printed as soon as the ones before them are done) with a progress line on stderr; with `--json` each
prompt becomes one JSON object on stdout. User mistakes (unknown model, bad sampling values, a prompt
longer than the context) end with a one-line message and exit status 2, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from mleagle.engine.contract.cli_flags import add_device_args, add_tp_args, depth_list, tp_overrides

EXIT_USAGE = 2


class UsageError(Exception):
    """A mistake in the command line or its inputs; the message is printed as is."""


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mleagle generate", description="Offline generation with the mleagle engine.")
    p.add_argument("--model", default=None, help="bundled config name (smollm2-135m, tiny-dummy), .toml, .gguf or HF dir")
    add_device_args(p)
    p.add_argument("--prompt", action="append", default=[], help="prompt text (repeatable)")
    p.add_argument("--prompts-file", default=None, help="JSONL with `prompt` or `turns` (first turn used)")
    p.add_argument("--limit", type=int, default=None, help="use at most N prompts from the file")
    p.add_argument("--chat", action="store_true", help="apply the model's chat template (user turn)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--min-new-tokens", type=int, default=0)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=-1)
    p.add_argument("--min-p", type=float, default=0.0)
    p.add_argument("--repetition-penalty", type=float, default=1.0)
    p.add_argument("--presence-penalty", type=float, default=0.0)
    p.add_argument("--frequency-penalty", type=float, default=0.0)
    p.add_argument("--seed", type=int, default=None, help="engine seed: every request's draws derive from it")
    p.add_argument("--logprobs", type=int, default=None, metavar="N", help="logprob of each token + top-N")
    p.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--draft", default=None, help="PATH | random:S[:seed] | none")
    p.add_argument("--spec-steps", type=int, default=None)
    p.add_argument("--spec-policy", choices=["auto", "always", "off", "cycle"], default=None,
                   help="draft steps per iteration: auto (0..S, whatever pays; default), always (S), off (0)")
    p.add_argument("--spec-depths", type=depth_list, default=None,
                   help="comma list of the depths auto chooses between (default 0,S; e.g. 0,3,5)")
    p.add_argument("--attention-backend", choices=["auto", "torch", "triton", "flashinfer"], default=None,
                   help="auto: triton on CUDA, torch on the CPU")
    p.add_argument("--max-total-tokens", type=int, default=None, help="KV pool size in tokens")
    p.add_argument("--max-context-len", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--disable-prefix-cache", action="store_true", help="recompute every prompt (no prefix KV reuse)")
    p.add_argument("--threads", type=int, default=None)
    add_tp_args(p)
    p.add_argument("--json", action="store_true", help="one JSON object per prompt on stdout")
    p.add_argument("--no-progress", action="store_true", help="no progress line on stderr")
    return p


def read_prompts(path: str, limit: int | None) -> list[str]:
    f = Path(path)
    if not f.is_file():
        raise UsageError(f"prompts file not found: {path}")
    out: list[str] = []
    for n, line in enumerate(f.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise UsageError(f"{path}:{n}: not JSON ({e.msg})") from None
        if isinstance(row, dict) and isinstance(row.get("prompt"), str):
            out.append(row["prompt"])
        elif isinstance(row, dict) and isinstance(row.get("turns"), list) and row["turns"] and isinstance(row["turns"][0], str):
            out.append(row["turns"][0])
        else:
            raise UsageError(f"{path}:{n}: a row needs a string `prompt` or a non-empty list `turns`")
        if limit is not None and len(out) >= limit:
            break
    return out


def validation_message(e: ValidationError) -> str:
    """Pydantic's multi-line report as one line: `field: message; field: message`."""
    parts = []
    for err in e.errors():
        loc = ".".join(str(x) for x in err.get("loc", ())) or "value"
        parts.append(f"{loc}: {err.get('msg', 'invalid')}")
    return "; ".join(parts)


def engine_overrides(a: argparse.Namespace) -> dict[str, Any]:
    keys = {"device": a.device, "dtype": a.dtype, "draft": a.draft, "spec_steps": a.spec_steps,
            "spec_policy": a.spec_policy, "spec_depths": a.spec_depths, "max_total_tokens": a.max_total_tokens,
            "max_context_len": a.max_context_len,
            "max_running_requests": a.max_running_requests, "chunked_prefill_size": a.chunked_prefill_size,
            "threads": a.threads, "seed": a.seed, "attention_backend": a.attention_backend,
            "enable_prefix_cache": False if a.disable_prefix_cache else None}
    keys.update(tp_overrides(a))
    return {k: v for k, v in keys.items() if v is not None}


def sampling_params(a: argparse.Namespace) -> Any:
    from mleagle.engine.contract.sampling_params import SamplingParams

    return SamplingParams(
        max_new_tokens=a.max_new_tokens, min_new_tokens=a.min_new_tokens, temperature=a.temperature,
        top_p=a.top_p, top_k=a.top_k, min_p=a.min_p, repetition_penalty=a.repetition_penalty,
        presence_penalty=a.presence_penalty, frequency_penalty=a.frequency_penalty, stop=a.stop,
        ignore_eos=a.ignore_eos, logprobs=a.logprobs,
    )


def token_text(tok: Any, i: int) -> str:
    return tok.decode([i], skip_special_tokens=False) if tok is not None else ""


def logprobs_json(tok: Any, lps: list[Any] | None) -> list[dict[str, Any]] | None:
    if lps is None:
        return None
    return [{"token_id": lp.token_id, "token": token_text(tok, lp.token_id), "logprob": lp.logprob,
             "top": [[t, token_text(tok, t), v] for t, v in lp.top]} for lp in lps]


def completion_json(engine: Any, index: int, prompt: str, c: Any) -> dict[str, Any]:
    return {
        "index": index, "prompt": prompt, "token_ids": c.token_ids, "text": c.text,
        "finish_reason": c.finish_reason, "matched_stop": c.matched_stop,
        "logprobs": logprobs_json(engine.tokenizer, c.logprobs),
        "spec": c.spec.summary() if c.spec is not None else None,
        "num_prompt_tokens": len(c.prompt_ids), "num_output_tokens": len(c.token_ids),
        "e2e_s": round(c.timings.get("e2e_s", 0.0), 6),
    }


class Progress:
    """One self-overwriting stderr line: generated tokens, tokens/s, finished prompts."""

    def __init__(self, total: int, enabled: bool):
        self.total, self.enabled = total, enabled
        self.t0 = time.perf_counter()
        self.tokens = self.done = 0
        self.last = 0.0

    def update(self, new_tokens: int, finished: bool, force: bool = False) -> None:
        self.tokens += new_tokens
        self.done += int(finished)
        now = time.perf_counter()
        if self.enabled and (force or now - self.last > 0.25):
            self.last = now
            dt = max(now - self.t0, 1e-9)
            sys.stderr.write(f"\r[{self.done}/{self.total} done | {self.tokens} tokens | {self.tokens / dt:.1f} tok/s]")
            sys.stderr.flush()

    def close(self) -> None:
        if self.enabled and (self.tokens or self.done):
            self.update(0, False, force=True)
            sys.stderr.write("\n")
            sys.stderr.flush()


def stream_text(engine: Any, prompts: list[str], params: Any, chat: bool, progress: Progress) -> list[str | None]:
    """Stream every prompt's text in prompt order; returns each prompt's finish reason."""
    from mleagle.engine.contract.detokenizer import IncrementalDetokenizer, StopMatcher

    encoded = [engine.encode_prompt(p, chat) for p in prompts]
    tok = engine.tokenizer
    detoks = [IncrementalDetokenizer(tok, ids, params.skip_special_tokens) if tok else None for ids in encoded]
    stops = [StopMatcher(params.stop) for _ in prompts]
    pending = [""] * len(prompts)  # text of prompts not yet on screen
    reasons: list[str | None] = [None] * len(prompts)
    cur = 0  # the prompt whose text goes to stdout live
    out = sys.stdout
    multi = len(prompts) > 1

    def show(i: int, text: str) -> None:
        if i == cur:
            out.write(text)
            out.flush()
        else:
            pending[i] += text

    def header(i: int) -> None:
        if multi:
            out.write(f"{'' if i == 0 else chr(10)}=== [{i}] {prompts[i][:60]!r}\n")

    header(0)
    for i, o in engine.stream(encoded, params):
        text = ""
        if detoks[i] is not None and o.token_ids:
            text = stops[i].push(detoks[i].push(o.token_ids))[0]
        if o.finished:
            if detoks[i] is not None:
                text += stops[i].push(detoks[i].flush())[0] + stops[i].flush()
            reasons[i] = o.finish_reason if o.error is None else f"error: {o.error}"
        show(i, text)
        progress.update(len(o.token_ids), o.finished)
        while cur < len(prompts) and reasons[cur] is not None:
            if multi:
                out.write(f"\n--- finish_reason={reasons[cur]}\n")
            cur += 1
            if cur < len(prompts):
                header(cur)
                out.write(pending[cur])
                pending[cur] = ""
            out.flush()
    if not multi:
        out.write("\n")
    out.flush()
    return reasons


def run(a: argparse.Namespace) -> int:
    prompts = list(a.prompt)
    if a.prompts_file:
        prompts += read_prompts(a.prompts_file, a.limit)
    elif a.limit is not None:
        prompts = prompts[: a.limit]
    if not prompts:
        raise UsageError("no prompts: give --prompt TEXT or --prompts-file FILE.jsonl")
    params = sampling_params(a)
    from mleagle.engine.contract.config import load_config
    from mleagle.engine.service.tp_driver import start_engine

    cfg = load_config(a.model)
    t0 = time.perf_counter()
    engine = start_engine(cfg, **engine_overrides(a))
    if not a.no_progress:
        print(f"mleagle: {cfg.model.name} ({engine.cfg.engine.dtype}, {engine.cfg.engine.device}) loaded in "
              f"{time.perf_counter() - t0:.1f}s", file=sys.stderr)
    try:
        if a.json:
            comps = engine.generate(prompts, params, chat=a.chat)
            for i, (p, c) in enumerate(zip(prompts, comps)):
                print(json.dumps(completion_json(engine, i, p, c), ensure_ascii=False), flush=True)
            return 0
        progress = Progress(len(prompts), not a.no_progress)
        try:
            stream_text(engine, prompts, params, a.chat, progress)
        finally:
            progress.close()
        return 0
    finally:
        engine.close()  # with --tp: the other ranks stop too


def main(argv: list[str]) -> int:
    a = build_parser().parse_args(argv)
    try:
        return run(a)
    except UsageError as e:
        print(f"mleagle generate: {e}", file=sys.stderr)
    except ValidationError as e:
        print(f"mleagle generate: invalid value: {validation_message(e)}", file=sys.stderr)
    except (ValueError, FileNotFoundError, ImportError) as e:
        # EngineInputError (a ValueError) covers too-long and empty prompts; load_config names the models
        msg = str(e).splitlines()[0] if str(e) else type(e).__name__
        print(f"mleagle generate: {msg}", file=sys.stderr)
    except KeyboardInterrupt:
        print("\nmleagle generate: interrupted", file=sys.stderr)
        return 130
    return EXIT_USAGE

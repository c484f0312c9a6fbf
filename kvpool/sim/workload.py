"""Workloads for the simulator: synthetic generators, named scenarios and JSONL traces.

A request's prompt is kept as a *recipe* of segments, not as token ids, so that 100,000
requests cost little memory; ``prompt_tokens`` builds the ids when the request is
admitted. Equal segments give equal ids, so requests that share a system prompt (or a
conversation's history) share a token prefix exactly as real requests do:

- ``(PREFIX, group, n)``: the shared prefix of a group (a system prompt, a template);
- ``(USER, request_id, n)``: text unique to one request (a question, a user turn);
- ``(OUTPUT, request_id, n)``: what a request generated; a later turn of the same
  conversation repeats it in its prompt.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

PREFIX, USER, OUTPUT = 0, 1, 2
_MARK = (1 << 30, 2 << 30, 3 << 30)  # distinct first token per segment kind and key

Segment = tuple[int, int, int]  # (kind, key, length)


def segment_tokens(kind: int, key: int, length: int) -> list[int]:
    """Token ids of a segment: a marker naming (kind, key), then filler ids."""
    if length <= 0:
        return []
    return [_MARK[kind] + key, *range(1, length)]


@dataclass(slots=True)
class Request:
    request_id: int
    arrival: float  # seconds; for a follow-up turn, the think time after ``follows`` ends
    segments: tuple[Segment, ...]
    output_len: int
    follows: int = -1  # the previous turn of the same conversation, or -1
    raw_prompt: tuple[int, ...] | None = None  # exact ids, from a trace

    @property
    def prompt_len(self) -> int:
        if self.raw_prompt is not None:
            return len(self.raw_prompt)
        return sum(seg[2] for seg in self.segments)

    def prompt_tokens(self) -> list[int]:
        if self.raw_prompt is not None:
            return list(self.raw_prompt)
        tokens: list[int] = []
        for kind, key, length in self.segments:
            tokens.extend(segment_tokens(kind, key, length))
        return tokens

    def output_tokens(self) -> list[int]:
        return segment_tokens(OUTPUT, self.request_id, self.output_len)


@dataclass
class Workload:
    name: str
    requests: list[Request]
    context_length: int
    description: str = ""
    prefix_segments: dict[int, Segment] = field(default_factory=dict)  # group -> segment

    def prefix_tokens(self) -> list[list[int]]:
        """Token ids of each shared prefix (for pinning)."""
        return [segment_tokens(*seg) for seg in self.prefix_segments.values()]


# -- length distributions -------------------------------------------------------------------
@dataclass(frozen=True)
class LengthDist:
    """A mixture of uniform integer ranges, e.g. ``80%:200-500,20%:10-1500``."""

    parts: tuple[tuple[float, int, int], ...]

    @classmethod
    def parse(cls, text: str) -> LengthDist:
        parts = []
        for item in text.split(","):
            m = re.fullmatch(r"\s*(?:(\d+(?:\.\d+)?)%:)?(\d+)(?:-(\d+))?\s*", item)
            if not m:
                raise ValueError(
                    f"bad length distribution {text!r} (e.g. '80%:200-500,20%:10-1500')"
                )
            weight = float(m.group(1)) if m.group(1) else 100.0
            lo = int(m.group(2))
            hi = int(m.group(3)) if m.group(3) else lo
            if lo > hi or lo < 0:
                raise ValueError(f"bad range {lo}-{hi} in {text!r}")
            parts.append((weight, lo, hi))
        return cls(tuple(parts))

    def sample(self, rng: random.Random) -> int:
        _, lo, hi = rng.choices(self.parts, weights=[p[0] for p in self.parts])[0]
        return rng.randint(lo, hi)

    def __str__(self) -> str:
        total = sum(p[0] for p in self.parts)
        return ",".join(f"{100 * w / total:.0f}%:{lo}-{hi}" for w, lo, hi in self.parts)


_SHORT_PROMPTS = LengthDist.parse("32-256")
_MOSTLY_200_500 = LengthDist.parse("80%:200-500,20%:10-1500")


@dataclass(frozen=True)
class SyntheticSpec:
    """Parameters of a synthetic workload (see ``generate``)."""

    name: str = "custom"
    num_requests: int = 200
    rate: float = 4.0  # Poisson arrivals per second of new conversations; 0 = all at t=0
    context_length: int = 2048
    prompt_len: LengthDist = _SHORT_PROMPTS  # unique text per request or turn
    output_len: LengthDist = _MOSTLY_200_500
    system_prompt_len: int = 0
    system_prompt_share: float = 1.0  # share of conversations that carry a shared prefix
    num_prefix_groups: int = 1  # distinct shared prefixes (templates, system prompts)
    turns: tuple[int, int] = (1, 1)  # turns per conversation
    think_time: float = 10.0  # seconds between a reply and the next turn
    seed: int = 0
    description: str = ""


def generate(spec: SyntheticSpec) -> Workload:
    """Conversations arrive as a Poisson process; each turn resends the whole history.

    ``num_requests`` counts requests (turns), not conversations.
    """
    rng = random.Random(spec.seed)
    requests: list[Request] = []
    prefixes: dict[int, Segment] = {}
    t = 0.0
    while len(requests) < spec.num_requests:
        if spec.rate > 0:
            t += rng.expovariate(spec.rate)
        history: tuple[Segment, ...] = ()
        if spec.system_prompt_len > 0 and rng.random() < spec.system_prompt_share:
            group = rng.randrange(spec.num_prefix_groups)
            prefixes[group] = (PREFIX, group, spec.system_prompt_len)
            history = (prefixes[group],)
        turns = rng.randint(*spec.turns)
        previous = -1
        for _ in range(turns):
            if len(requests) >= spec.num_requests:
                break
            rid = len(requests)
            user = (USER, rid, spec.prompt_len.sample(rng))
            segments = (*history, user)
            prompt_len = sum(s[2] for s in segments)
            room = spec.context_length - prompt_len
            if room < 1:
                break  # the conversation has filled the context
            out = max(1, min(spec.output_len.sample(rng), room))
            arrival = t if previous < 0 else spec.think_time
            requests.append(Request(rid, arrival, segments, out, follows=previous))
            history = (*segments, (OUTPUT, rid, out))
            previous = rid
    return Workload(spec.name, requests, spec.context_length, spec.description, prefixes)


# -- named scenarios --------------------------------------------------------------------------
NAMED: dict[str, SyntheticSpec] = {
    "seed": SyntheticSpec(
        name="seed",
        num_requests=400,
        rate=1.0,
        context_length=2048,
        prompt_len=LengthDist.parse("32-256"),
        output_len=LengthDist.parse("80%:200-500,20%:10-1500"),
        system_prompt_len=256,
        description=(
            "the seed article's setting: 2,048-token context, a shared 256-token system "
            "prompt, most requests generating 200-500 tokens, Poisson arrivals"
        ),
    ),
    "chat": SyntheticSpec(
        name="chat",
        num_requests=400,
        rate=0.5,
        context_length=4096,
        prompt_len=LengthDist.parse("20-120"),
        output_len=LengthDist.parse("50-300"),
        system_prompt_len=400,
        turns=(3, 8),
        think_time=8.0,
        description=(
            "multi-turn chat: a shared 400-token system prompt, 3-8 turns per conversation, "
            "each turn resending the whole history"
        ),
    ),
    "templated": SyntheticSpec(
        name="templated",
        num_requests=256,
        rate=0.0,
        context_length=2048,
        prompt_len=LengthDist.parse("20-60"),
        output_len=LengthDist.parse("20-100"),
        system_prompt_len=512,
        num_prefix_groups=4,
        description="a batch of templated prompts: 4 templates of 512 tokens, 20-60 filled in",
    ),
    "distinct": SyntheticSpec(
        name="distinct",
        num_requests=400,
        rate=2.0,
        context_length=2048,
        prompt_len=LengthDist.parse("100-1000"),
        output_len=LengthDist.parse("50-500"),
        description="no shared prefix at all: distinct prompts of 100-1,000 tokens",
    ),
}


# -- traces -----------------------------------------------------------------------------------
def load_trace(path: str | Path, context_length: int) -> Workload:
    """Read a JSONL trace: one request a line, with ``arrival`` (seconds), ``output_len``,
    and either ``prompt_tokens`` (ids) or ``prompt_len`` plus optional ``prefix_group``
    (any id) and ``prefix_len`` (how many of the prompt's tokens the group shares)."""
    groups: dict[object, int] = {}
    prefixes: dict[int, Segment] = {}
    requests: list[Request] = []
    with Path(path).open() as f:
        for line_no, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                rid = len(requests)
                out = int(rec["output_len"])
                arrival = float(rec["arrival"])
                if "prompt_tokens" in rec:
                    raw = tuple(int(x) for x in rec["prompt_tokens"])
                    requests.append(Request(rid, arrival, (), out, raw_prompt=raw))
                    continue
                prompt_len = int(rec["prompt_len"])
                segments: list[Segment] = []
                if rec.get("prefix_group") is not None:
                    group = groups.setdefault(rec["prefix_group"], len(groups))
                    plen = min(int(rec.get("prefix_len", prompt_len)), prompt_len)
                    prefixes[group] = (PREFIX, group, plen)
                    segments.append((PREFIX, group, plen))
                    prompt_len -= plen
                if prompt_len > 0:
                    segments.append((USER, rid, prompt_len))
                requests.append(Request(rid, arrival, tuple(segments), out))
            except (KeyError, ValueError, TypeError) as exc:
                raise ValueError(f"{path}:{line_no}: bad trace record: {exc}") from None
    requests.sort(key=lambda r: r.arrival)
    for i, r in enumerate(requests):  # ids follow arrival order
        r.request_id = i
    return Workload(Path(path).stem, requests, context_length, f"trace {path}", prefixes)


def write_trace(workload: Workload, path: str | Path) -> None:
    """Write single-turn requests as a JSONL trace (follow-up turns are written with their
    absolute arrival as generated, so a trace replays them open-loop)."""
    with Path(path).open("w") as f:
        for r in _flatten_arrivals(workload.requests):
            rec: dict[str, object] = {"arrival": round(r.arrival, 6), "output_len": r.output_len}
            prefix = [s for s in r.segments if s[0] == PREFIX]
            if r.raw_prompt is not None or any(s[0] == OUTPUT for s in r.segments):
                rec["prompt_tokens"] = r.prompt_tokens()
            else:
                rec["prompt_len"] = r.prompt_len
                if prefix:
                    rec["prefix_group"] = prefix[0][1]
                    rec["prefix_len"] = prefix[0][2]
            f.write(json.dumps(rec) + "\n")


def _flatten_arrivals(requests: Iterable[Request]) -> list[Request]:
    by_id = {r.request_id: r for r in requests}
    out = []
    for r in by_id.values():
        t = r.arrival
        prev = r.follows
        while prev >= 0:
            t += by_id[prev].arrival
            prev = by_id[prev].follows
        out.append(Request(r.request_id, t, r.segments, r.output_len, -1, r.raw_prompt))
    return sorted(out, key=lambda r: r.arrival)

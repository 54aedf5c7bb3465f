"""The decoding loop as flat functions, and the ``Generator`` that drives them.

Mode ``ar`` (this file's baseline): prefill every prompt in one batched forward, then one
token per row per step. Greedy output is token-identical to HF ``generate(do_sample=False)``.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass, field

import torch

from . import cuda_device
from .arg_checks import flag, real, whole
from .call_inputs import arrival_steps, check_positions, per_prompt, stop_string_check, stop_token_set
from .errors import SwiftkernError
from .fork_guard import warn_if_forked_with_threads
from .kv_cache import KVCache
from .layer_kernels import invariant_backend, invariant_kernels_available
from .rope_table import rope_follows_the_batch
from .model import SkipModel
from .batch_invariant import bi_token_logprob
from .prompt_ids import encode_prompts
from .prefill import admit_arrivals, per_row_pays, prefill  # noqa: F401 (prefill: part of this module's API)
from .requests import Requests
from .sampling import SEED_RANGE, SamplingParams, select_with_uniforms, token_uniforms
from .device_reads import CLOCK as READ_CLOCK, read
from .draft_head import DEFAULT_DRAFT_VOCAB, DraftHead
from .drafter_policy import DrafterPolicy
from . import layer_set_store
from .layer_skip_draft import DraftPolicy
from .speculative import decode_self_spec
from .tuner import OnTheFlyTuner, tuner_options
from .deterministic import decode_deterministic
from .fast_path import FastPath
from .cuda_graphs import GraphRunner
from .generator_options import MODES, check_options, is_auto, parse_layer_set, replay_elided



@dataclass
class GenerationOutput:
    """What ``Generator.generate`` returns: per prompt, the new token ids (EOS included when
    generated, as HF), their text, and stats; ``stats`` sums over the batch."""

    tokens: list[list[int]]
    texts: list[str] | None
    prompt_tokens: list[list[int]]
    stats: dict = field(default_factory=dict)
    request_stats: list[dict] = field(default_factory=list)
    logprobs: list[torch.Tensor] | None = None  # deterministic mode: the verifier's, float32 [new]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def decode_ar(model: SkipModel, cache: KVCache, first_logits: torch.Tensor, params: SamplingParams,
              seeds: list[int], requests: Requests, logprobs: list[list[torch.Tensor]] | None = None,
              prompts: list[list[int]] | None = None) -> int:
    """Plain autoregressive decoding into ``requests``. first_logits: [B, V] from prefill.

    One token per unfinished row per step; finished rows leave the batch, and requests that
    arrive later (``Requests.arrive_at``; their ``prompts`` given) join it at their step,
    prefilled on their own (``admit_arrivals``). logprobs: per request, a list that gets each
    new token's log-probability (``bi_token_logprob``, float32 [1] each). -> decode steps
    """
    logits, steps = first_logits, 0
    u = None  # float32 [B]: the uniforms logits' rows are sampled with, made before their forward
    while True:
        new = admit_arrivals(model, cache, requests, prompts)
        if new is not None:
            logits = new if logits is None else torch.cat([logits, new.to(logits.dtype)])
            u = None  # rows joined: made again (one more wait for the device, on such steps only)
        if u is None and params.do_sample:
            positions = list(cache.host_lengths)  # absolute position of the token chosen now
            u = token_uniforms(params, [seeds[r] for r in requests.alive], positions, logits.device)
        next_tokens = select_with_uniforms(logits, params, u)  # [B]
        if logprobs is not None:
            lps = bi_token_logprob(logits, next_tokens)  # [B]
            for i, r in enumerate(requests.alive):
                logprobs[r].append(lps[i:i + 1])
        for r, t in zip(requests.alive, read(next_tokens)):
            requests.commit(r, [t])
        next_tokens = requests.drop_finished(cache, next_tokens)
        requests.step += 1
        if next_tokens is None:
            if not requests.waiting:
                return steps
            logits, u = None, None  # an empty batch: the next arrivals join at once
            continue
        if params.do_sample:  # the next step's uniforms copied in before the forward (after its launch the copy waits)
            u = token_uniforms(params, [seeds[r] for r in requests.alive], [n + 1 for n in cache.host_lengths],
                               next_tokens.device)
        logits = model.forward(next_tokens.unsqueeze(1), cache)[:, -1]  # [B, V]
        steps += 1


def acceptance_stats(counts: dict, verifies: int) -> dict:
    """mean accepted drafts per verify, and accepted / drafted."""
    return {"mean_accepted": counts["accepted"] / verifies if verifies else 0.0,
            "acceptance_rate": counts["accepted"] / counts["drafted"] if counts["drafted"] else 0.0}


class Generator:
    """Generates text with a LLaMA-family model.

    ``Generator(model, tokenizer=None, mode="ar", layer_set=None, k_max=25, eps=0.8,
    adaptive_eps=False, drafter="auto", draft_vocab=8192)``: ``model`` is a ``SkipModel`` or an
    HF LLaMA/Mistral/Qwen2/Qwen3 causal LM (wrapped, weights shared); ``tokenizer`` is needed for
    text prompts and ``texts``.
    Modes: ``ar`` (plain decoding; greedy is token-identical to HF ``generate``) and
    ``self-spec`` (draft, verify all drafts in one full pass, keep the matching prefix; greedy
    output equals ``ar``, sampled output has the same distribution; on the CPU with the C++
    kernels both decode through the batch- and length-invariant kernels, so the equality is
    bit for bit, ``invariant_decode``). Drafters of self-spec:
    ``layer-skip`` drafts with ``layer_set`` skipped (a ``LayerSet`` or its string/JSON form),
    up to ``k_max`` tokens while the draft's top-1 probability is >= ``eps``, its logits over a
    pruned head of ``draft_vocab`` frequent tokens plus the prompt's and output's tokens (None:
    the full head); ``lookup`` drafts what followed the longest suffix (up to 8 tokens) of
    prompt + output where it occurred before, the most common continuation (no model call), as
    many of its tokens (or none) per step as the measured verify costs and lookup's running
    acceptance for matches of that length say pay (a verify of 16 tokens costs 1.9 decode steps on SmolLM2/CPU:
    drafting every match up to k_max = 25 made lookup 1.10x ``ar``); ``none`` drafts nothing;
    ``auto`` (default) picks among lookup, layer-skip (when a layer set is given) and none per
    row and step, for the most expected tokens per second from the costs and acceptance measured while it runs
    (``drafter_policy.DrafterPolicy``). ``layer_set="auto"`` finds the layer set while
    generating (SWIFT's schedule, ``tuner.OnTheFlyTuner``; ``skip_ratio`` a fraction or "auto"
    for a ladder of ratios judged by measured speed; ``search_options`` go to the tuner),
    starting from the set ``swiftkern search`` stored for this model when there is one; what it
    finds carries over to this Generator's later calls (``reset_search()`` forgets it).
    Mode ``deterministic`` (LLM-42, ``deterministic.decode_deterministic``): a prompt's output
    and ``logprobs`` are the same bits whatever else is in the batch. With the replay, rows
    decode together (regular batched decoding; ``drafter="self-spec"``: prompt-lookup drafts where a row's
    context repeats, else the draft with ``layer_set`` skipped, stopping at confidence < ``eps``),
    and every ``window`` unverified tokens are replayed in a
    fixed-shape ``verify_batch x window`` batch-invariant pass that commits the matching prefix
    plus its own token at the first mismatch (a call's passes are ``min(window, max_new_tokens +
    1)`` wide: no row can fill more, and the verifier's kernels give a token the same bits at any
    width; a window of 16384 for 12 new tokens took 5.1 s instead of 0.008 s on a tiny model).
    ``replay="auto"`` (default) skips that replay where it cannot change a bit: on the CPU with the C++ kernels (float32, bfloat16 or float16), every
    decode, verify and prefill runs the batch- and length-invariant kernels (``SkipModel.batch_invariant``), so
    rows decode as in ``ar`` (``drafter="self-spec"``: as in self-spec, the drafter policy over
    lookup, the layer-skipped draft and no draft, whose verify passes are the invariant model)
    and ``logprobs`` are those of the model itself; ``replay="always"`` keeps the LLM-42 replay;
    ``replay="never"`` decodes through the invariant kernels wherever a set runs, also on CUDA
    (the verifier's Triton kernels: ``bi_matmul`` in place of cuBLAS for every step), instead
    of replaying. On CUDA ``"auto"`` takes that way too, except with ``drafter="self-spec"``,
    whose replayed steps cost less there (``replay_elided``; measured by ``python -m bench
    --routine determinism``, its ``det-invariant`` / ``det-replay`` rows).
    ``verifier_kernels``: the replay's per-row ops, "auto" | "portable" | "fused"
    (``verifier_kernels.verifier_kernels``: auto is fused, with the C++ kernels on the CPU and
    Triton on CUDA, where they run; portable elsewhere).
    ``cuda_graphs=True`` (a model on a CUDA device) replays the forwards of decode, draft and
    verify steps through CUDA graphs captured on a shape's second use (``cuda_graphs.GraphRunner``,
    kept across calls; or pass a ``GraphRunner`` to share its graphs between Generators of its
    model, e.g. across HF ``generate(custom_generate=...)`` calls with ``swift_kwargs=
    {"cuda_graphs": runner}``); prefill of long prompts and the search's scoring passes run
    eagerly.
    """

    def __init__(self, model, tokenizer=None, mode: str = "ar", layer_set=None, k_max: int = 25,
                 eps: float = 0.8, adaptive_eps: bool = False, drafter: str = "auto",
                 draft_vocab: int | None = DEFAULT_DRAFT_VOCAB, window: int = 32, verify_batch: int = 4,
                 skip_ratio="auto", search_options: dict | None = None, replay: str = "auto",
                 cuda_graphs=False, verifier_kernels: str = "auto"):
        if mode not in MODES:
            raise SwiftkernError(f"unknown mode {mode!r}; available: {', '.join(MODES)}")
        if isinstance(cuda_graphs, GraphRunner) and cuda_graphs.model.hf_model is model:
            model = cuda_graphs.model  # an HF model whose runner (and its graphs) a caller keeps
        self.model = model if isinstance(model, SkipModel) else SkipModel.from_hf(model)
        self.tokenizer = tokenizer
        self.k_max = whole("k_max", k_max, 1)
        self.eps = real("eps", eps)
        if not 0.0 <= self.eps <= 1.0:
            raise SwiftkernError(f"eps must be in [0, 1], got {self.eps}")
        self.adaptive_eps = flag("adaptive_eps", adaptive_eps)
        self.window, self.verify_batch = whole("window", window, 1), whole("verify_batch", verify_batch, 1)
        self.search_options = tuner_options(search_options)
        check_options(self.model, mode, drafter, layer_set, replay, verifier_kernels, skip_ratio,
                      self.search_options, self.adaptive_eps)
        self.mode, self.drafter, self.replay, self.verifier_kernels = mode, drafter, replay, verifier_kernels
        self.skip_ratio = skip_ratio
        self.auto_layer_set = is_auto(layer_set)
        self.layer_set = parse_layer_set(None if self.auto_layer_set else layer_set, self.model.num_layers)
        self.draft_vocab = None if draft_vocab is None else whole("draft_vocab (None: the full head)", draft_vocab, 1)
        self._tuner_state: OnTheFlyTuner | None = None  # layer_set "auto": kept across calls
        self._drafter_costs: dict = {}  # the drafter policy's timed costs per batch size: kept across calls
        if isinstance(cuda_graphs, GraphRunner):
            self.graph_runner = cuda_graphs
        elif cuda_graphs is True:
            self.graph_runner = GraphRunner(self.model)
        elif cuda_graphs is False or cuda_graphs is None:
            self.graph_runner = None
        else:
            raise SwiftkernError(f"cuda_graphs must be True, False or a GraphRunner, got {cuda_graphs!r}")
        if self.graph_runner is not None and self.graph_runner.model is not self.model:
            raise SwiftkernError("cuda_graphs: the GraphRunner was made for another model")

    def _tuner(self, chooser) -> OnTheFlyTuner:
        """SWIFT's on-the-fly search. The first call starts it from the set ``swiftkern search``
        stored for this model when there is one; later calls go on with this Generator's tuner
        (SWIFT optimizes on the first inputs of a task and drafts with the result on the rest):
        a found set drafts at once, a search that was cut short resumes, and a verdict that
        layer skipping cannot pay on this model and machine stands (``reset_search()`` clears it)."""
        if self._tuner_state is None:
            record = layer_set_store.load(self.model)
            self._tuner_state = OnTheFlyTuner(self.model.num_layers, chooser, self.skip_ratio,
                                              initial=record["layer_set"] if record else None, **self.search_options)
        else:
            self._tuner_state.new_generation(chooser)
        return self._tuner_state

    def _call_cache(self, batch: int, needed: int, used: int):
        """A context holding this call's KVCache: a fresh one, or with CUDA graphs the runner's
        (``GraphRunner.lease``)."""
        if self.graph_runner is None:
            return contextlib.nullcontext(self.model.new_cache(batch, needed, used))
        return self.graph_runner.lease(batch, needed, used)

    def reset_search(self) -> None:
        """Forget what the on-the-fly layer-set search found; the next call searches anew."""
        self._tuner_state = None

    def replay_elided(self) -> bool:
        """Whether mode deterministic skips the LLM-42 replay here: ``replay="never"`` (decoding
        through the invariant set wherever it runs: the CPU's C++ kernels or CUDA's Triton
        kernels), or ``replay="auto"`` where the C++ invariant set runs (the CPU) or, without the
        self-spec drafter, where the Triton set runs on CUDA: there every step through it costs
        less than regular steps plus the replay (H100, SmolLM2, CUDA graphs, ``python -m bench
        --routine determinism``: 2.46x / 1.28x / 0.91x ``ar`` against 0.93x / 0.72x / 0.87x at
        batch 8 / 32 / 1 in float32, 0.70x / 0.73x / 0.72x against 0.53x / 0.49x / 0.64x in
        bfloat16), while the self-spec drafter's steps there are cheaper replayed (0.86x against 0.49x)."""
        return replay_elided(self.model, self.mode, self.replay, self.drafter)

    def invariant_decode(self) -> bool:
        """Whether this Generator's decoding passes (decode steps, drafts, verify passes; not the
        prompts' prefill) run the batch- and length-invariant kernels (``SkipModel.batch_invariant``):
        modes ar and self-spec where those kernels run (the CPU with the C++ kernels, float32,
        bfloat16 or float16), and mode deterministic without replay (its prefill too). A verify
        pass then gives each token the bits a decode step gives it, so self-spec's greedy output
        is ar's bit for bit, not only to rounding. It costs nothing measurable there: SmolLM2 on
        the CPU, float32, 96 tokens, decode time invariant / regular 0.98-1.03x over ar and
        self-spec at batch 1, 8 and 32; the prefill keeps the regular set, whose float32 matmul
        takes long prompts faster (600 tokens: the invariant set 1.26x the time)."""
        return self.replay_elided() or (
            self.mode in ("ar", "self-spec")
            and invariant_kernels_available(self.model.device.type, self.model.dtype)
            and not rope_follows_the_batch(self.model.rotary))  # its table would hold other frequencies

    def _draft_head(self, ids: list[list[int]]) -> DraftHead | None:
        if self.draft_vocab is None or self.draft_vocab >= self.model.vocab_size:
            return None
        return DraftHead.for_model(self.model, self.draft_vocab, [t for p in ids for t in p])

    def _decode_invariant(self, cache, first_logits, params, seeds, requests, ids) -> dict:
        """Mode deterministic without replay, inside ``batch_invariant()``: ``ar`` decoding, or
        with drafter self-spec the speculative loop (drafter policy over lookup, the layer-skipped
        draft and no draft). Every row's bits are its own whatever the batch, so nothing needs
        replaying; with sampling, the choices that pick which drafts a row verifies depend on
        that row alone (no timings, no shared pruned head, no pass width fitted to the batch),
        which keeps its samples its own."""
        logprobs: list[list[torch.Tensor]] = [[] for _ in ids]
        stats = {}
        if self.drafter == "self-spec":
            seeded = params.do_sample
            chooser = DrafterPolicy(("lookup", "layer-skip", "none"), self.k_max, measure=not seeded,
                                    costs=self._drafter_costs, rows_alone=seeded)
            head = None if seeded else self._draft_head(ids)  # a pruned head grows with every row's tokens
            policy = DraftPolicy(k_max=self.k_max, eps=self.eps)
            stats = decode_self_spec(self.model, cache, first_logits, params, seeds,
                                     requests, self.layer_set, policy, "auto", ids, chooser, head, None, logprobs)
            stats.pop("per_row")
            fast_steps = stats["draft_steps"] + stats["verify_steps"]
        else:
            fast_steps = decode_ar(self.model, cache, first_logits, params, seeds, requests, logprobs, ids)
        decoded = [len(t) - 1 for t in requests.out]  # as the replay counts: every token but the prefill's
        stats.update(replay="elided: batch-invariant kernels", fast_steps=fast_steps, fast_tokens=sum(decoded),
                     prefill_passes=0, verify_passes=0, dummy_rows=0, rolled_back=0, corrected=0,
                     rollback_fraction=0.0, logprobs=[torch.cat(lp) for lp in logprobs],
                     per_row=[{"verifies": 0, "fast_tokens": n, "rolled_back": 0} for n in decoded])
        return stats

    # --- inputs ------------------------------------------------------------------------
    def encode(self, prompts, chat: bool = False) -> list[list[int]]:
        """str | list[str] | list[int] | list[list[int]] | integer tensor or NumPy array [T] or
        [B, T] | a list of 1-D ones -> token id lists (``prompt_ids.encode_prompts``: text through
        the tokenizer, ids checked)."""
        return encode_prompts(prompts, self.tokenizer, self.model.vocab_size, flag("chat", chat))

    def _decode(self, cache: KVCache, first_logits, params: SamplingParams, seeds: list[int], requests: Requests,
                ids: list[list[int]], verified: list[bool], invariant: bool, window: int) -> tuple[int, dict]:
        """The decoding loop of this Generator's mode after the prefill -> (steps, the loop's stats).
        ``window``: this call's replay width (mode deterministic)."""
        spec_stats = {}
        if self.mode == "ar":
            steps = decode_ar(self.model, cache, first_logits, params, seeds, requests, prompts=ids)
        elif invariant:
            spec_stats = self._decode_invariant(cache, first_logits, params, seeds, requests, ids)
            steps = spec_stats["fast_steps"]
        elif self.mode == "deterministic":
            fast = FastPath()
            if self.drafter == "self-spec":
                fast = FastPath(self.layer_set, self.eps, self._draft_head(ids), lookup=True)
            spec_stats = decode_deterministic(self.model, cache, ids, params, seeds, requests, window,
                                              self.verify_batch, fast, verified, self.verifier_kernels)
            steps = spec_stats["fast_steps"] + spec_stats["verify_passes"]
        else:
            # seeded sampling: rejection sampling draws from the drafts, so the drafts a row
            # verifies must follow its own tokens alone: no pass width fitted to the batch, no
            # pruned head grown from every row's tokens, no layer-set search over the batch
            # (seeded calls draft with lookup alone there); adaptive eps is refused in generate
            seeded = params.do_sample
            search = self.auto_layer_set and not seeded
            policy = DraftPolicy(k_max=self.k_max, eps=self.eps, adaptive=self.adaptive_eps)
            uses_skip = self.drafter == "layer-skip" or (self.drafter == "auto" and (
                self.layer_set is not None or search))
            chooser = None
            if self.drafter in ("auto", "lookup"):  # lookup too: how many of its drafts pay is a cost question
                allowed = ("lookup", "none") + (("layer-skip",) if uses_skip else ())
                chooser = DrafterPolicy(allowed, self.k_max, measure=not seeded,  # seeded: no timing
                                        costs=self._drafter_costs, rows_alone=seeded)
            head = self._draft_head(ids) if uses_skip and not seeded else None
            tuner = self._tuner(chooser) if search else None
            start_set = tuner.current if tuner is not None and tuner.enabled else self.layer_set
            spec_stats = decode_self_spec(self.model, cache, first_logits, params, seeds, requests,
                                          start_set, policy, self.drafter, ids, chooser, head, tuner)
            if tuner is not None:
                spec_stats.update(tuner.stats(), searched_layer_set=str(tuner.current or ""))
            steps = spec_stats["draft_steps"] + spec_stats["verify_steps"]
        return steps, spec_stats

    def _check_sampling_fits(self, params: SamplingParams) -> None:
        """Seeded sampling keeps a row's tokens its own only if the drafts it verifies follow
        its tokens alone (rejection sampling draws from them): refuse the options that steer
        every row's drafts from the whole batch."""
        if not params.do_sample or self.mode != "self-spec":
            return
        if self.adaptive_eps:
            raise SwiftkernError("adaptive_eps moves one eps for the whole batch, so a row's sampled tokens "
                                 "would follow the other rows: sample with adaptive_eps=False, or decode greedily")
        if self.auto_layer_set and self.drafter == "layer-skip":
            raise SwiftkernError("layer_set='auto' searches over the whole batch, so a row's sampled tokens would "
                                 "follow the other rows; with do_sample give a layer set, or drafter auto (sampled "
                                 "calls then draft with prompt lookup)")

    # --- the call ----------------------------------------------------------------------
    def generate(self, prompts, max_new_tokens: int = 64, do_sample: bool = False,
                 temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0, seed: int | list[int] = 0,
                 eos_token_id: int | list[int] | None = None, stop_token_ids: list[int] | None = None,
                 stop: list[str] | None = None, chat: bool = False,
                 deterministic: bool | list[bool] = True, streamer=None,
                 arrive_at: list[int] | None = None) -> GenerationOutput:
        """Generate up to ``max_new_tokens`` for each prompt (a batch of any lengths).

        Greedy when ``do_sample`` is False; otherwise temperature → top-k → top-p, drawing
        with uniforms keyed on (seed, absolute position), so a prompt's output depends on its
        seed alone. ``seed`` may be one int or one per prompt, in [-2**63, 2**64) (s < 0 is the
        seed 2**64 + s, as in torch). Generation of a row stops after an EOS token
        (``eos_token_id``, default the model's generation config's), a ``stop_token_ids`` token
        (each one id or a list), a ``stop`` string in its text, or ``max_new_tokens``. The
        generation config gives the EOS only: its sampling fields (``do_sample``, temperature,
        ``repetition_penalty``, ...) are this call's arguments, as given; HF's ``generate`` with
        ``custom_generate`` reads them (or refuses those it cannot run). Mode deterministic: ``deterministic``
        (one bool or one per prompt) False lets a request skip verification (regular decoding);
        where no replay runs (``replay_elided()``) every row decodes through the invariant kernels,
        so every request is deterministic and the flags change nothing (on the CPU at no
        measurable cost; on CUDA every row pays ``bi_matmul``: with few deterministic requests
        ``replay="always"`` may cost less; unmeasured). ``streamer(request, tokens)``: called with each request's
        tokens as they become final (only verified ones in mode deterministic), in order, while
        decoding runs (``streaming.TextStream`` makes text of them); its time counts in the stats.
        ``arrive_at`` (one int per prompt, at least one 0): the decoding step at which each
        request joins the batch, as requests arrive at a server while others decode (dynamic
        batching; a step is a decode step, a draft-and-verify step of self-spec, or a fast step
        of mode deterministic's replay); every mode. Calls on one model from several threads
        run one at a time (``SkipModel.lock``); a streamer may call ``generate`` itself.
        Returns ``GenerationOutput``.
        """
        max_new_tokens = whole("max_new_tokens", max_new_tokens, 1)
        if streamer is not None and not callable(streamer):
            raise SwiftkernError(f"streamer must be a callable streamer(request, tokens), got {type(streamer).__name__}")
        params = SamplingParams(do_sample, temperature, top_k, top_p)
        self._check_sampling_fits(params)
        ids = self.encode(prompts, chat)
        seeds = per_prompt("seeds", seed, len(ids), lambda s: whole("seed", s, *SEED_RANGE))
        arrive_at = arrival_steps(arrive_at, len(ids))
        verified = per_prompt("deterministic flags", deterministic, len(ids), lambda d: flag("deterministic", d))
        if not all(verified) and self.mode != "deterministic":
            raise SwiftkernError("deterministic=False for some prompts needs mode='deterministic'")
        self.model.check_unchanged()  # weights replaced since the wrap would be read stale
        longest = max(len(p) for p in ids)
        check_positions(self.model, longest, max_new_tokens)
        stop_ids = stop_token_set(self.model, self.tokenizer, eos_token_id, stop_token_ids)
        device = self.model.device
        warn_if_forked_with_threads(device)
        # a verify pass may overshoot by K+1, K at most k_max and a row's remaining tokens
        spec_slack = min(self.k_max, max_new_tokens) + 1
        slack = spec_slack if self.mode == "self-spec" else 0
        window = min(self.window, max_new_tokens + 1)  # this call's replay width: no row fills more
        if self.mode == "deterministic":  # a window-wide replay, or (self-spec) a verify pass
            slack = max(window, spec_slack if self.drafter == "self-spec" else 0)
        start = [r for r in range(len(ids)) if arrive_at is None or arrive_at[r] == 0]  # the first batch
        needed, used = longest + max_new_tokens + slack, longest + max_new_tokens
        # one call at a time on this model (its contexts, a runner's cache); a call from inside
        # this one (a streamer's) gets a cache of its own
        with self.model.lock, cuda_device.current(device), self._call_cache(len(start), needed, used) as cache:
            if self.model.packed is not None:  # weights written through .data since the last call
                self.model.packed.refresh()
            invariant = self.replay_elided()  # every pass invariant, the prefill too
            graphs = self.model.cuda_graphs(self.graph_runner) if self.graph_runner else contextlib.nullcontext()
            graph_stats = self.graph_runner.stats() if self.graph_runner else None
            with self.model.batch_invariant(invariant), graphs:
                _sync(device)
                t0 = time.perf_counter()
                # deterministic mode with replay prefills through its verifier
                replayed = self.mode == "deterministic" and not invariant
                # one forward per prompt where the invariant set is the CPU's compute-bound C++
                # kernels (padding costs its full share); Triton's (CUDA) pads: one pass, the same
                # bits (row- and length-invariant), not a pass of host time per prompt
                per_row = (invariant and invariant_backend(device.type, self.model.dtype) == "cpp") or per_row_pays(
                    self.model)
                first_logits = (prefill(self.model, cache, [ids[r] for r in start], per_row=per_row)
                                if not replayed else None)
                _sync(device)
                t1 = time.perf_counter()
                requests = Requests(len(ids), max_new_tokens, stop_ids, stop_string_check(self.tokenizer, stop), streamer, arrive_at,
                                    invariant_prefill=invariant)
                waited, reads = READ_CLOCK.snapshot()
                with self.model.batch_invariant(self.invariant_decode()):
                    steps, spec_stats = self._decode(cache, first_logits, params, seeds, requests, ids, verified,
                                                     invariant, window)
            _sync(device)
            t2 = time.perf_counter()
            t1 += spec_stats.pop("prefill_s", 0.0)  # the replay prefills through its verifier inside decoding
            spec_stats.update(read_wait_s=READ_CLOCK.seconds - waited, device_reads=READ_CLOCK.reads - reads)
            return self._output(requests.out, ids, steps, spec_stats, (t0, t1, t2), graph_stats)

    def _output(self, tokens: list[list[int]], ids: list[list[int]], steps: int, spec_stats: dict,
                times: tuple[float, float, float], graph_stats: dict | None) -> GenerationOutput:
        """The call's GenerationOutput: texts, the stats of the call and of each request.
        times: (start, prefill done, decoding done) from time.perf_counter()."""
        t0, t1, t2 = times
        texts = None
        if self.tokenizer is not None:
            texts = [self.tokenizer.decode(t, skip_special_tokens=True) for t in tokens]
        new = sum(len(t) for t in tokens)
        decoded = new - len(tokens)  # the first token of each row comes from prefill
        request_stats = [{"prompt_tokens": len(p), "new_tokens": len(t)} for p, t in zip(ids, tokens)]
        stats = {
            "mode": self.mode,
            "batch": len(ids),
            "prompt_tokens": sum(len(p) for p in ids),
            "new_tokens": new,
            "prefill_s": t1 - t0,
            "decode_s": t2 - t1,
            "steps": steps,
            "tokens_per_s": new / (t2 - t0),
            "decode_tokens_per_s": decoded / (t2 - t1) if t2 > t1 and decoded else 0.0,
            "decode_kernels": "batch-invariant" if self.invariant_decode() else "regular",
            # decoding's reads of device results (device_reads): on a GPU the host waited there, and
            # the rest of decode_s is host work the GPU waited for
            "read_wait_s": spec_stats.pop("read_wait_s"),
            "device_reads": spec_stats.pop("device_reads"),
        }
        if self.graph_runner is not None:  # this call's share of the runner's counts
            now = self.graph_runner.stats()
            kinds = now["replays_by_kind"]
            stats["cuda_graphs"] = dict(
                {k: now[k] - graph_stats[k] for k in ("captures", "replays", "eager")}, graphs=now["graphs"],
                replays_by_kind={k: n - graph_stats["replays_by_kind"].get(k, 0) for k, n in kinds.items()})
        if self.mode == "self-spec":
            per_row = spec_stats.pop("per_row")
            layer_set = str(self.layer_set) if self.layer_set is not None and self.drafter in ("layer-skip", "auto") else ""
            stats.update(spec_stats, drafter=self.drafter, layer_set=layer_set,
                         **acceptance_stats(spec_stats, spec_stats["row_verifies"]))
            for req, row in zip(request_stats, per_row):
                req.update(row, **acceptance_stats(row, row["verifies"]))
        logprobs = None
        if self.mode == "deterministic":
            per_row, logprobs = spec_stats.pop("per_row"), spec_stats.pop("logprobs")
            window = spec_stats.pop("window", None)  # the replay's shape, where it ran
            replayed = {} if self.replay_elided() else dict(
                window=window, verify_batch=spec_stats.get("verify_batch", self.verify_batch))
            stats.update(spec_stats, **replayed,
                         fast_path="self-spec " + str(self.layer_set) if self.drafter == "self-spec" else "ar")
            for req, row in zip(request_stats, per_row):
                req.update(row)
        return GenerationOutput(tokens, texts, ids, stats, request_stats, logprobs)

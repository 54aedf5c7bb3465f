"""Plant one bug at a time in the decoding loops' and the kernels' source and see whether the
tests catch it.

    .venv/bin/python tools/mutation_sweep.py            # every mutant below
    .venv/bin/python tools/mutation_sweep.py M10,M23    # some of them
    .venv/bin/python tools/mutation_sweep.py --tests tests/test_self_spec.py M10
    .venv/bin/python tools/mutation_sweep.py --check      # does every mutant still apply? (no runs)

Each mutant replaces one exact snippet of a file (it must occur once) in a git worktree of HEAD,
runs the tests on it (``-x``, two xdist workers, no slow tests) and prints KILLED (a test failed)
or SURVIVED with the first failing tests. The checkout itself is never touched. A survivor is a
place to look: a bug no test sees, or an equivalent change (listed in EQUIVALENT with the reason).

A mutant runs its own tests where it names them (the kernel mutants K.., and M40 on), else the
loop and op tests (TESTS); ``--tests`` overrides both. Where no mutant is in csrc's C++, the C++
extension is copied in from this checkout, so build it first. A mutant in csrc's C++ rebuilds
the worktree's extension with it and again without it (the first such mutant
builds the whole extension there once: minutes on two cores); one in a CUDA file runs in the
CPU emulation of CUDA (tests/cuda_emu), which builds itself from the worktree's sources; the
Triton kernels run under the interpreter without a GPU (tests/conftest.py), as in ``make test``."""

from __future__ import annotations

import argparse
import glob
import os
import shutil
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TESTS = [f"tests/test_{name}.py" for name in (
    "self_spec", "generate", "kv_cache", "streaming", "arrivals", "deterministic", "acceptance", "exact_self_spec",
    "lookup", "lookup_index", "lookup_replay", "deterministic_steps", "greedy_accept", "rejection_sample",
    "feature_mix", "hf_integration", "host_reads", "replay_policy", "drafter_policy", "call_inputs", "top_p",
    "input_contract", "keyed_draws", "generator_options", "draft_head", "decoder_stack")]

# (id, file, snippet, replacement, the bug it plants[, the tests to run instead of TESTS])
MUTANTS = [
    ("M01", "swiftkern/speculative.py", "committed = row[: num_accepted[i] + 1]",
     "committed = row[: num_accepted[i]] or row[:1]", "self-spec drops the bonus token"),
    ("M02", "swiftkern/speculative.py", "cache.rollback([n + 1 + a for n, a in zip(base, verified.num_accepted)])",
     "cache.rollback([n + a for n, a in zip(base, verified.num_accepted)])", "rollback one position short"),
    ("M03", "swiftkern/speculative.py", 'counts["accepted"] += min(num_accepted[i], n)',
     'counts["accepted"] += num_accepted[i]', "stats count drafts accepted past a stop"),
    ("M04", "swiftkern/verify_step.py", "flat_positions = [s + 1 + j for s in start",
     "flat_positions = [s + j for s in start", "rejection sampling's uniforms keyed one position early"),
    ("M05", "swiftkern/requests.py", "len(out) >= self.max_new_tokens", "len(out) > self.max_new_tokens",
     "one token past max_new_tokens"),
    ("M06", "swiftkern/requests.py", "return [j if j in stays else next(tail) for j in range(n)]", "return list(kept)",
     "a departure moves more rows than it needs"),
    ("M07", "swiftkern/kv_cache.py", "        if old in written:\n            return True",
     "        if old in written:\n            return False", "select_rows overwrites a row it still reads"),
    ("M08", "swiftkern/kv_cache.py", "        if new != self.host_lengths:\n            self.set_lengths(new)",
     "        if new != self.host_lengths:\n            self.host_lengths = new", "rollback leaves the device lengths"),
    ("M09", "swiftkern/speculative.py", 'if c.drafter != "layer-skip" for j, t in enumerate(rows[i])]',
     "for j, t in enumerate(rows[i])]", "a layer-skipped draft's q made one-hot"),
    ("M10", "swiftkern/speculative.py", "    probs[at[0], at[1], at[2]] = 1.0", "    probs[at[0], at[1], at[2]] = 0.0",
     "lookup drafts get q = 0 in sampled mixed rows"),
    ("M11", "swiftkern/deterministic_steps.py", "commit, rest = row.unverified[:match] + [preds[match]], []",
     "commit, rest = row.unverified[:match + 1], []", "the replay commits the fast token at a mismatch"),
    ("M12", "swiftkern/deterministic_steps.py", "commit, rest = row.unverified + [preds[compared]], []",
     "commit, rest = (row.unverified or [preds[compared]]), []", "a matched short window loses the verifier's token"),
    ("M13", "swiftkern/deterministic_steps.py",
     "lengths[s.row] = self.vlen(alive[s.row]) - 1 + len(rows[s.row].unverified)",
     "lengths[s.row] = self.vlen(alive[s.row]) + len(rows[s.row].unverified)", "cache one position long after a pass"),
    ("M14", "swiftkern/deterministic_steps.py", "row.stopped = row.stopped and bool(rest)", "row.stopped = False",
     "a stop among the tokens past the window is forgotten"),
    ("M15", "swiftkern/deterministic_steps.py", "positions = [s.start + 1 + j for s in slots for j in s.want]",
     "positions = [s.start + j for s in slots for j in s.want]", "the verifier's uniforms keyed one position early"),
    ("M16", "swiftkern/requests.py", "due = [r for r in self.waiting if self.arrive_at[r] <= self.step]",
     "due = [r for r in self.waiting if self.arrive_at[r] < self.step]", "arrivals join one step late"),
    ("M17", "swiftkern/verify_step.py", "next_pending = out.gather(1, acc.unsqueeze(1)).squeeze(1)",
     "next_pending = out[:, -1]", "the next pending token from the last slot"),
    ("M18", "swiftkern/verify_step.py", "return bi_token_logprob(self.logits[i, :n], self.out[i, :n])",
     "return bi_token_logprob(self.logits[i, :n], self.out[i, :n].flip(0))", "logprobs of the wrong tokens"),
    ("M19", "swiftkern/kv_cache.py", "            m = self.host_lengths[old]\n", "            m = self.host_lengths[new]\n",
     "select_rows copies the wrong length"),
    ("M20", "swiftkern/kv_cache.py", "        self.lengths[first:] = 0\n", "", "added rows keep stale device lengths"),
    ("M21", "swiftkern/layer_skip_draft.py", "if confidence[b] < policy.eps:", "if confidence[b] < policy.eps and False:",
     "the confidence stop ignored"),
    ("M22", "swiftkern/sampling.py", "    return idx.clamp_(max=weights.shape[-1] - 1)",
     "    return idx.clamp_(max=weights.shape[-1] - 2)", "the inverse-CDF draw never picks the last id"),
    ("M23", "swiftkern/sampling.py", '        out.masked_fill_(out < kth, float("-inf"))',
     '        out.masked_fill_(out < kth - 1e-3, float("-inf"))', "top-k keeps near-ties below the k-th value"),
    ("M24", "swiftkern/deterministic_steps.py", "fed = row.unverified[:T - 1]",
     "fed = row.unverified[:T - 2] if T > 2 else row.unverified[:T - 1]", "the replay feeds one token fewer"),
    ("M25", "swiftkern/generate.py", "[n + 1 for n in cache.host_lengths],", "[n for n in cache.host_lengths],",
     "ar's sampled draws keyed on the previous token's position"),
    ("M26", "swiftkern/streaming.py", "        if text.endswith(_INCOMPLETE):\n            return\n", "",
     "TextStream writes half characters"),
    ("M27", "swiftkern/lookup_index.py", "                if end:\n", "                if True:\n",
     "the index's pairs wrap around at position 0"),
    ("M28", "swiftkern/lookup_index.py", "for at in range(T - 2, max(P - 2 - offset, -1), -1):",
     "for at in range(T - 2, max(P - 1 - offset, -1), -1):", "the index skips the last indexed end"),
    ("M29", "swiftkern/drafters.py", "while n < longest and n <= end and", "while n < longest and n < end and",
     "a lookup match cannot reach position 0"),
    ("M30", "swiftkern/drafters.py", "    top = max(votes.values())\n    chosen = next(end for end in ends if votes[con",
     "    top = min(votes.values())\n    chosen = next(end for end in ends if votes[con",
     "the vote picks the least common continuation"),
    ("M31", "swiftkern/requests.py", "self.stop_check(r, tokens)", "self.stop_check(r, tokens[:-1])",
     "a stop string seen one token late"),
    ("M32", "swiftkern/generator_options.py", 'return replay == "never" or invariant_kernels_available',
     "return invariant_kernels_available", "replay='never' ignored on CUDA with the self-spec drafter"),
    ("M33", "swiftkern/kv_cache.py", "if max(self.host_lengths) + num_new > self.max_len:",
     "if max(self.host_lengths) + num_new >= self.max_len:", "the cache refuses an exact fit"),
    ("M34", "swiftkern/verify_step.py", "u_sample = _chunk_uniforms(seeds, start, K + 1, STREAM_RESIDUAL, device)",
     "u_sample = _chunk_uniforms(seeds, start, K + 1, STREAM_ACCEPT, device)",
     "the residual draw reuses the acceptance test's uniform"),
    ("M35", "swiftkern/verifier.py", "real += real[-1:] * (R * T - len(real))", "real += [0] * (R * T - len(real))",
     "a verify pass's padded writes land on the first slot's position in the last slot's row"),
    ("M36", "swiftkern/verifier.py", "key_blocks = -(-(max(s.start for s in slots) + T) // KEY_BLOCK)",
     "key_blocks = -(-(max(s.start for s in slots) + 1) // KEY_BLOCK)", "a verify pass's keys end short of its tokens"),
    ("M37", "swiftkern/draft_head.py", "                if n:\n                    rows[:n] = self._rows[i][:n]\n", "",
     "the pruned draft head loses its rows when it grows"),
    ("M38", "swiftkern/verifier.py", "k = head_norm(kern, k.view(R, T, Hkv, D), w.k_norm, m.eps)",
     "k = head_norm(kern, k.view(R, T, Hkv, D), None, m.eps)", "the verifier drops Qwen3's key-head norm"),
    ("M39", "swiftkern/model.py", "q = head_norm(kern, q.view(B, T, self.num_heads, self.head_dim), w.q_norm, self.eps)",
     "q = head_norm(kern, q.view(B, T, self.num_heads, self.head_dim), w.k_norm, self.eps)",
     "the runner's Python loop norms Qwen3's query heads with the key-head weight"),
]

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from kernel_mutants import KERNEL_MUTANTS  # noqa: E402
from more_mutants import MORE_MUTANTS  # noqa: E402
from support_mutants import SUPPORT_MUTANTS  # noqa: E402
from reference_mutants import REFERENCE_MUTANTS  # noqa: E402
from compile_check_mutants import COMPILE_CHECK_MUTANTS  # noqa: E402

MUTANTS += MORE_MUTANTS + SUPPORT_MUTANTS + REFERENCE_MUTANTS + COMPILE_CHECK_MUTANTS + KERNEL_MUTANTS

EQUIVALENT = {
    "M04": "every acceptance and residual key moves by one position in every step alike, so no key is used "
           "twice and each draw stays a fresh uniform: the same distribution, the same invariance",
    "K35": "the softmax denominator's lanes are still fixed by the key index alone, so each query's bits still "
           "do not depend on the batch or the chunk (the invariant kernel's contract); attention's bits are "
           "not claimed equal across instruction sets (each sums its scores in its own order), and the "
           "reordered sum is far inside the tolerance against the definition",
    "M210": "the reference's lanes are still summed in an order fixed by K alone, so a row stays independent of M "
            "and of the other rows (its contract, tested); no kernel claims the reference's bits (the C++ kernel "
            "fuses each multiply-add, the Triton plans tile K), so which tree sums the 16 lanes is not observable",
    "M178": "a tensor from outside is named by its data_ptr(), which includes the storage offset (the address a "
            "graph bakes in), and a view of a tensor made inside is itself made by a logged launch (slice, select, "
            "as_strided) whose host arguments hold the offset: the offset field repeats what the signature has",
    "K50": "on a CPU without AVX-512 only: there the regular attention's one difference from the invariant one, "
           "its multi-query lane path, is not compiled in (AVX-512 only), so both give the same bits (checked "
           "at T = 8, 40-2000 keys, float32 and bf16); on an AVX-512 CPU the change is real and caught "
           "(tools/mutation_sweep-k50-avx512-258a956.txt, an AMD EPYC with AVX-512)",
}


def builds_the_extension(path: str) -> bool:
    """Whether a mutant of this file needs the worktree's C++ extension built: csrc's C++ does;
    the CUDA files do not (the CPU emulation of CUDA builds itself from them)."""
    return path.startswith("csrc/") and not path.endswith((".cu", ".cuh"))


def build(worktree: str, env: dict) -> str | None:
    """Build the worktree's C++ extension in place (ninja recompiles what changed) -> None, or
    the end of the compiler's output where the build failed."""
    done = subprocess.run([sys.executable, "setup.py", "-q", "build_ext", "--inplace"], cwd=worktree, env=env,
                          capture_output=True, text=True)
    return None if done.returncode == 0 else (done.stdout + done.stderr)[-400:]


def run(mutant, worktree: str, tests: list[str] | None, env: dict) -> str:
    """tests: the files to run (None: the mutant's own, else TESTS)."""
    mid, path, old, new, what = mutant[:5]
    tests = tests or (mutant[5] if len(mutant) > 5 else TESTS)
    native = builds_the_extension(path)
    file = os.path.join(worktree, path)
    with open(file) as f:
        source = f.read()
    if source.count(old) != 1:
        return f"{mid} STALE: the snippet occurs {source.count(old)} times in {path}"
    with open(file, "w") as f:
        f.write(source.replace(old, new))
    for db in glob.glob(os.path.join(worktree, "**", ".hypothesis"), recursive=True):
        shutil.rmtree(db, ignore_errors=True)  # a failing example saved by the last mutant replays
    start = time.time()
    try:
        failure = build(worktree, env) if native else None
        if failure is not None:  # a mutant the compiler refuses is no bug a test could miss
            return f"{mid} UNBUILT {what}: {failure!r}"
        done = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-n", "2", "-p", "no:cacheprovider",
                               "-m", "not slow", *tests], cwd=worktree, env=env, capture_output=True, text=True)
    finally:
        with open(file, "w") as f:
            f.write(source)
        if native and build(worktree, env) is not None:
            raise RuntimeError(f"{mid}: the extension does not build again without the mutant")
    failed = [line for line in done.stdout.splitlines() if line.startswith(("FAILED", "ERROR"))][:2]
    verdict = "KILLED" if done.returncode != 0 else "SURVIVED"
    note = f" (equivalent: {EQUIVALENT[mid]})" if verdict == "SURVIVED" and mid in EQUIVALENT else ""
    return f"{mid} {verdict} {time.time() - start:.0f}s {what}{note} {failed if failed else ''}".rstrip()


def stale(root: str = ROOT) -> list[str]:
    """What keeps a mutant from running in the checkout at ``root``: a snippet that does not
    occur exactly once in its file, a test file that is not there, an id used twice."""
    problems, seen = [], set()
    for mutant in MUTANTS:
        mid, path, old = mutant[:3]
        if mid in seen:
            problems.append(f"{mid}: the id is used twice")
        seen.add(mid)
        file = os.path.join(root, path)
        count = 0
        if os.path.exists(file):
            with open(file) as f:
                count = f.read().count(old)
        if count != 1:
            problems.append(f"{mid}: the snippet occurs {count} times in {path}")
        problems += [f"{mid}: no test file {t}" for t in (mutant[5] if len(mutant) > 5 else TESTS)
                     if not os.path.exists(os.path.join(root, t))]
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("ids", nargs="?", default="", help="comma-separated mutant ids (default: all)")
    parser.add_argument("--tests", default=None, help="comma-separated test files to run on each mutant "
                                                      "(default: the mutant's own, else the loop and op tests)")
    parser.add_argument("--check", action="store_true",
                        help="run nothing: list the mutants that cannot run here (exit 1 if any)")
    args = parser.parse_args()
    if args.check:
        problems = stale()
        print("\n".join(problems) or f"all {len(MUTANTS)} mutants apply to this checkout")
        return 1 if problems else 0
    wanted = set(filter(None, args.ids.split(",")))
    unknown = wanted - {m[0] for m in MUTANTS}
    if unknown:
        parser.error(f"unknown mutant ids: {', '.join(sorted(unknown))}")
    built = glob.glob(os.path.join(ROOT, "swiftkern", "_C*.so"))
    if not built:
        parser.error("no swiftkern/_C*.so here: build the extension first (make setup)")
    worktree = tempfile.mkdtemp(prefix="swiftkern-mutants-")
    subprocess.run(["git", "worktree", "add", "--detach", "-q", worktree, "HEAD"], cwd=ROOT, check=True)
    try:
        # the worktree's Triton kernels as swiftkern.triton_kernels (setup.py's package_dir): the
        # editable install's finder would hand out this checkout's, and every Triton mutant survive
        os.symlink(os.path.join("..", "triton_kernels"), os.path.join(worktree, "swiftkern", "triton_kernels"))
        env = dict(os.environ, PYTHONPATH=worktree, MAX_JOBS="2")
        where = subprocess.run([sys.executable, "-c", "import swiftkern, swiftkern.triton_kernels as t; "
                                "print(swiftkern.__file__); print(t.__file__)"], cwd=worktree, env=env,
                               capture_output=True, text=True, check=True).stdout.split()
        if not all(os.path.realpath(p).startswith(os.path.realpath(worktree) + os.sep) for p in where):
            raise RuntimeError(f"the tests would import {where}, not the worktree's code")
        chosen = [m for m in MUTANTS if not wanted or m[0] in wanted]
        if any(builds_the_extension(m[1]) for m in chosen):
            print("building the worktree's extension (once)...", flush=True)
            failure = build(worktree, env)
            if failure is not None:
                raise RuntimeError(f"the worktree's extension does not build: {failure}")
        else:
            for so in built:
                shutil.copy(so, os.path.join(worktree, "swiftkern"))
        for mutant in chosen:
            print(run(mutant, worktree, args.tests.split(",") if args.tests else None, env), flush=True)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", worktree], cwd=ROOT)
    return 0


if __name__ == "__main__":
    sys.exit(main())

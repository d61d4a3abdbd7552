"""The differential harness's distributed transport: one launch of K gloo processes per K.

Each rank runs every case of its launch twice (``run_engine`` builds a
``DistributedGPipe``) and returns what it holds; the parent merges the ranks'
parts into what a user of the whole pipeline observes.
"""

from __future__ import annotations

from differential_cases import BALANCES, Case, balance_of
from differential_run import ERRORS, Observed, expected_error, run_engine

from gpipe_lab.pipeline.distributed import GroupUnusableError
from gpipe_lab.pipeline.distributed.spawn import run_local

PER_LAUNCH = 100  # cases per launch of K processes (each launch within ``timeout``)


def worker(rank: int, world: int, recipes: list[str], balances: dict) -> list[tuple[Observed, Observed]]:
    BALANCES.update(balances)  # the parent's cuts: a measured one (``time``) differs between processes
    out = []
    for r in recipes:
        first = run_engine(Case.parse(r))
        # an error leaves the process group unusable (the next pipe raises GroupUnusableError): a
        # refused case is the last of its launch and runs once
        pair = (first, first if "error" in first else run_engine(Case.parse(r)))
        if any(str(o.get("error", "")).startswith(GroupUnusableError.__name__) for o in pair):
            # an earlier case of this launch failed mid-step: fail the launch, so that its cases
            # run again one launch each (``differential_full``) and only the failing one fails
            raise RuntimeError(f"the process group became unusable before case {r}")
        out.append(pair)
    return out


def _balances(cases: list[Case]) -> dict:
    """The zoo cases' cuts, computed here (a cut that fails to compute fails on each rank alike)."""
    for case in cases:
        if case.model != "lab":
            try:
                balance_of(case)
            except ERRORS:
                pass
    return dict(BALANCES)


def merge(parts: list[Observed]) -> Observed:
    """One observation from the ranks': the first value found of each item (every rank
    computes the loss and a forward's output; a gradient or buffer lives on one rank)."""
    errors = [p["error"] for p in parts if "error" in p]
    if errors:
        return {"error": errors[0]}
    out: Observed = {"probe": sorted(x for p in parts for x in p["probe"])}  # type: ignore[attr-defined]
    out["sparse"] = sorted({n for p in parts for n in p["sparse"]})  # type: ignore[attr-defined]
    for key in ("loss", "norm", "outputs"):
        found = [p[key] for p in parts if key in p]
        if key == "outputs" and found:
            found = [[next((o[i] for o in found if o[i] is not None), None) for i in range(len(found[0]))]]
        if found:
            out[key] = found[0]
    for key in ("grads", "buffers"):
        union: dict = {}
        for p in parts:
            for name, value in p[key].items():  # type: ignore[union-attr]
                if union.get(name) is None:
                    union[name] = value
        out[key] = union
    grads = [p["input_grad"] for p in parts]
    out["input_grad"] = [next((g[i] for g in grads if g[i] is not None), None) for i in range(len(grads[0]))]
    return out


def run_distributed(cases: list[Case], timeout: float = 600) -> dict[Case, tuple[Observed, Observed]]:
    """Every case's two runs, one launch of K processes per K (per ``PER_LAUNCH`` cases). A case
    that fails mid-step leaves its launch's process group unusable (``failure``'s docstring): the
    launch's next pipe then raises ``GroupUnusableError``, and so does one after a refusal, so a
    case that must be refused is the last of its launch.

    Raises:
        RuntimeError: a rank failed or hung (its error text and the launch's recipes).
    """
    results: dict[Case, tuple[Observed, Observed]] = {}
    launches = []
    for K in sorted({c.K for c in cases}):
        same = [c for c in cases if c.K == K and expected_error(c) is None]
        groups = [same[i:i + PER_LAUNCH] for i in range(0, len(same), PER_LAUNCH)]
        # after a refusal in train_step the launch's next pipe raises GroupUnusableError (the job's
        # abort key outlives the pipe): a case that must be refused ends a launch
        for j, case in enumerate(c for c in cases if c.K == K and expected_error(c) is not None):
            if j < len(groups):
                groups[j].append(case)
            else:
                groups.append([case])
        launches += groups
    for group in launches:
        ranks = run_local(worker, group[0].K, args=([c.recipe() for c in group], _balances(group)), timeout=timeout)
        failed = [r for r in ranks if r.exitcode != 0]
        if failed:
            recipes = "\n".join(c.recipe() for c in group)
            raise RuntimeError(f"rank {failed[0].rank} exit {failed[0].exitcode}: {failed[0].error}\n"
                               f"cases of this launch:\n{recipes}")
        for i, case in enumerate(group):
            results[case] = (merge([r.value[i][0] for r in ranks]), merge([r.value[i][1] for r in ranks]))
    return results

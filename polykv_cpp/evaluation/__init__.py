"""Evaluation of PolyKV plans against FullKV and the single-pattern baselines.

    polykv-cpp eval MODEL.gguf --budgets 128,256,512,1024 --lengths 4096,8192

Modules: `tasks` (RULER-style synthetic tasks generated offline from a seed, natural texts for perplexity/KL,
LongBench from local files), `scoring` (task metrics, perplexity/KL, gap recovered), `runner` (the sweep over
methods x budgets x protocols, with reuse of tokenization, FullKV results and prefill state), `report` (JSON,
markdown, PNG plots), `cli` (the `eval` sub-command). See docs/evaluation.md.
"""

__all__ = ["DEFAULT_METHODS", "EvalConfig", "run_eval"]


def __getattr__(name: str):
    # lazy: `polykv-cpp --help` registers the eval sub-command without importing numpy and the runner
    if name in __all__:
        from polykv_cpp.evaluation import runner

        return getattr(runner, name)
    raise AttributeError(f"module 'polykv_cpp.evaluation' has no attribute {name!r}")

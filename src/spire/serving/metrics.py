"""The Prometheus metrics of ``spire serve`` (``GET /metrics``): the engine's counters and the round policy's
measurements, read from one :meth:`~spire.engine.engine.Engine.status` at each scrape (:class:`EngineCollector`)."""

from __future__ import annotations

from spire.engine.engine import Engine


class EngineCollector:
    """The engine's counters as Prometheus metric families, read at each scrape (prometheus_client's custom
    collector: the engine keeps its own counters, so nothing is counted twice). Counter names end in ``_total``."""

    def __init__(self, engine: Engine, draft: str) -> None:
        self.engine, self.draft = engine, draft

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        eng, draft = self.engine.status(), self.draft
        st, policy = eng.stats, eng.k_policy

        def gauge(name: str, help_: str, value: float | None = None, labels: tuple = (), samples=()):
            m = GaugeMetricFamily(name, help_, value=value, labels=list(labels) or None)
            for lv, v in samples:
                m.add_metric(list(lv), v)
            return m

        def counter(name: str, help_: str, value: float | None = None, labels: tuple = (), samples=()):
            m = CounterMetricFamily(name, help_, value=value, labels=list(labels) or None)
            for lv, v in samples:
                m.add_metric(list(lv), v)
            return m

        yield gauge("spire_requests_running", "Requests holding a slot.", eng.running)
        yield gauge("spire_requests_waiting", "Requests queued for a slot.", eng.waiting)
        yield gauge("spire_requests_prefilling", "Requests holding a slot whose prompt is still being prefilled "
                    "(chunked prefill; counted in running too).", eng.prefilling)
        yield gauge("spire_slots", "Slots (max running requests).", eng.max_running)
        yield counter("spire_prompt_tokens_total", "Prompt tokens prefilled.", st.prompt_tokens)
        yield counter("spire_generation_tokens_total", "Tokens generated.", st.generated_tokens)
        yield counter("spire_rounds_total", "Engine rounds (draft, verify, accept, commit).", st.rounds)
        yield counter("spire_request_rounds_total", "Rounds summed over the requests in them.", labels=("draft",),
                      samples=[((draft,), st.row_rounds)])
        yield counter("spire_accepted_tokens_total", "Draft tokens accepted by verification.", labels=("draft",),
                      samples=[((draft,), sum(i * c for i, c in enumerate(st.accepted)))])
        yield gauge("spire_tau", "Tokens per round per request, bonus included (tau), over every request-round "
                    "(AD rounds included; spire_draft_tau: per draft, over the rounds that drafted with it).",
                    labels=("draft",),
                    samples=[((draft,), round(st.tau, 6))])
        yield gauge("spire_acceptance_rate", "Share of request-rounds that accepted draft token j (by position).",
                    labels=("draft", "position"),
                    samples=[((draft, str(j + 1)), round(a, 6)) for j, a in enumerate(st.acceptance())] if eng.k else [])
        if eng.k:
            yield counter("spire_rounds_by_k_total", "Rounds by draft tokens per row (k = 0: AD rounds, which draft "
                          "nothing; the draft label names the served draft set, as on every counter without a "
                          "per-draft breakdown).",
                          labels=("draft", "k"), samples=[((draft, str(k)), c) for k, c in enumerate(st.rounds_by_k)])
        if eng.k:
            yield counter("spire_request_rounds_by_draft_total", "Request-rounds by the draft the request drafted with "
                          "and its k (draft none, k 0: it drafted nothing in the round).", labels=("draft", "k"),
                          samples=[((name, str(k)), c) for name, counts in sorted(st.row_rounds_by_draft.items())
                                   for k, c in enumerate(counts) if c])
            yield gauge("spire_draft_acceptance_rate", "Per draft of the portfolio: the share of request-rounds that "
                        "drafted token j with it that accepted it (by position).", labels=("draft", "position"),
                        samples=[((name, str(j + 1)), round(a, 6)) for name in sorted(st.accepted_by_draft)
                                 for j, a in enumerate(st.draft_acceptance(name))])
            yield gauge("spire_draft_tau", "Per draft of the portfolio: tokens per request-round, bonus included, over "
                        "the request-rounds that drafted with it.", labels=("draft",),
                        samples=[((name,), round(st.draft_tau(name), 6)) for name in sorted(st.accepted_by_draft)])
            yield counter("spire_request_rounds_without_proposal_total", "Per draft: request-rounds in which it had no "
                          "proposal for the request (the n-gram lookup found no match), in rounds that could draft.",
                          labels=("draft",), samples=[((name,), c) for name, c in sorted(st.without_proposal.items())])
        acceptance = getattr(policy, "acceptance", None)
        if acceptance is not None:
            names = getattr(policy, "names", [])
            yield gauge("spire_policy_acceptance_rate", "The round policy's measured conditional acceptance of "
                        "draft token j given j - 1 accepted, over its recent window (mode greedy or sampled).",
                        labels=("draft", "mode", "position"),
                        samples=[((name, mode, str(j + 1)), round(c, 6)) for d, name in enumerate(names)
                                 for m, mode in enumerate(("greedy", "sampled"))
                                 for j, c in enumerate(acceptance.rates(d, m))])
        if policy is not None and hasattr(policy, "alpha"):
            yield gauge("spire_k_policy_alpha", "The k policy's estimate of the acceptance rate alpha.",
                        labels=("draft",), samples=[((draft,), round(policy.alpha, 6))])
        yield counter("spire_requests_finished_total", "Requests ended, by reason.", labels=("reason",),
                      samples=[((r,), c) for r, c in sorted(st.finished.items())])


def metrics_registry(engine: Engine, draft: str):
    """A prometheus_client registry of one :class:`EngineCollector` (``draft``: the label of the served draft)."""
    from prometheus_client import CollectorRegistry

    registry = CollectorRegistry(auto_describe=False)
    registry.register(EngineCollector(engine, draft))
    return registry


def metrics_text(registry) -> str:
    """Prometheus text exposition of a :func:`metrics_registry` (see docs/serving.md)."""
    from prometheus_client import generate_latest

    return generate_latest(registry).decode()

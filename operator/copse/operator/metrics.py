"""Every metric the operator exports, in one place."""

from prometheus_client import Counter, Gauge, Histogram

RECONCILES = Counter("copse_operator_reconciles_total", "Reconcile passes run.")
RECONCILE_ERRORS = Counter(
    "copse_operator_reconcile_errors_total", "Reconcile passes that failed and were retried."
)
RECONCILE_SECONDS = Histogram(
    "copse_operator_reconcile_duration_seconds",
    "Wall time of one reconcile pass, including its API calls.",
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10),
)
GANG_RESTARTS = Counter("copse_operator_gang_restarts_total", "TP groups torn down and placed again whole.")
PLACEMENT_SCORE = Gauge(
    "copse_operator_placement_score",
    "Placement score of a deployment in [0, 1]; 1 = every group ideally placed.",
    ["namespace", "deployment"],
)
UNPLACED_GROUPS = Gauge(
    "copse_operator_unplaced_groups",
    "TP groups of a deployment that no node set can hold now (its PlacementInfeasible condition).",
    ["namespace", "deployment"],
)

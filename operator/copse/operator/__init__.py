"""The Kubernetes operator: kopf watches, a level-triggered reconcile of InferenceDeployments into
gang-placed worker pods, group Services, the engine ConfigMap and the router (``copse operator run``)."""

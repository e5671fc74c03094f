"""The ``kvstore`` command line: the one package that knows both the server and the client.

It starts the server processes (``master``, ``daemon``, ``conductor``, ``cluster up``), drives the
client (``demo``, ``replay``, ``pd-demo``, the operator commands) and launches local clusters
(:class:`~kvstore_cli.cluster.LocalCluster`). Nothing under ``kvstore``, ``transfer``, ``server`` or
``kvstore_client`` imports it (``lint-imports`` checks this).
"""

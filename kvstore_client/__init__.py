"""kvstore client side: the CLI and workload replay (the network client arrives with the Cluster issue)."""

"""Transfer engine: moves block bytes between clients and daemons (transports arrive with the Cluster issue)."""

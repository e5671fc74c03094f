"""Server processes: master, storage daemon, conductor and the local cluster launcher (from the Cluster issue)."""

"""Server processes: the master, the storage daemon and the conductor."""

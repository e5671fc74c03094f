"""The storage daemon: one node's DRAM arena and SSD tier, carrying out the master's placement."""

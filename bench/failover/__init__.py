"""Failover and chaos benchmarks: a mesh on the tiny model with its processes killed, stopped and restarted."""

"""The moemesh tooling on top of the mesh: the `moemesh` command, the local launcher, a local etcd, stub generation.

It may import the library (`services`), the protos and start the roles as
processes; no role and no library module imports it.
"""

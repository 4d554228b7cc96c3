"""Ray side of the system: pools, placement groups, actors, health, config, the `pdcluster` CLI,
and capacity planning. The only package that imports Ray.
"""

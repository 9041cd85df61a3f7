"""How a run lies over processes: the process collectives (dist), the sharding layout and DeepSpeed ZeRO's
partitioned state."""

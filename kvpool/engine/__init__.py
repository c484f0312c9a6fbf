"""kvpool.engine: scheduling and sampling on top of the block manager and the runtime."""

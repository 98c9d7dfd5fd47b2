"""The core's seams: what the sandbox, the lifecycle engine, forks and the
ref server meet through, so that none of them imports another's concrete
class (see docs/architecture.md)."""

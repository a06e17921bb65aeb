"""Distributed programs: Ray Data distillation, Ray Train training."""

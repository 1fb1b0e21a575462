"""Monarch's ``monarch.gradient_generator`` path: ``grad_generator``, ``grad_function``, ``gradient_execution_order``."""

from monarch_tensor.controller.gradient_generator import grad_function, grad_generator, gradient_execution_order

__all__ = ["grad_function", "grad_generator", "gradient_execution_order"]

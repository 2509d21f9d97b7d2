"""OTCLR in JAX: contrastive learning with optimal-transport positive views."""

"""Rendering results for people: plots (matplotlib, imported only when a plot is asked for)."""

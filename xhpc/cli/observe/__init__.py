"""Commands that show the serving plane: ps, top, nodes, doctor."""

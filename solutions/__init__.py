"""Reference solutions of the course: one complete module per exercise template."""

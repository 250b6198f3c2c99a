"""Command-line interface: one thin module per subcommand."""

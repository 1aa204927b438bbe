"""`diloco run`: a whole job as local processes (launch, live progress, summary, plot). Only the CLI
imports this package."""

"""`checkpointless-bench`: the same job and the same fault under this project and its peers (`cli.bench`)."""

"""The remediator: diagnoses in, actions out, one incident per root cause, one leader."""

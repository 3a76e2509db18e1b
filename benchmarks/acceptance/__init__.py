"""Acceptance harnesses of earlier issues: whole flows on the dev set, judged over many requests."""

"""Criteria files (kvscope.criteria): no code. `media.yaml` ships with the package for `kvscope demo`; a regular
package, not a namespace one, so that an editable install finds it too (its folder is not under kvscope/)."""

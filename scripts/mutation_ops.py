"""Run mutmut with Coda's fixed mutation operator set (issue 8; report only, not CI).

mutmut's own operator table is a plain list; this wrapper replaces it before mutmut builds
any mutant, so the set is fixed here and documented in docs/testing.md:

* comparison   ``<``↔``<=``, ``>``↔``>=``, ``==``↔``!=``, ``is``↔``is not``, ``in``↔``not in``
* boolean      ``and``↔``or``, ``not x`` → ``x``, ``True``↔``False``
* arithmetic   ``+``↔``-``, ``*``↔``/``, ``//``/``%`` → ``/``, shifts and bit operators,
               ``+=``↔``-=``, ``x += y`` → ``x = y``
* constant     number literal ``n`` → ``n + 1``
* statement    one simple statement (call, assignment, return, raise, del, break, continue)
               → ``pass``

Not generated: string-literal mutants, argument removal, ``x = None`` assignments, string
method swaps, lambda and match mutants; lines that log (``log.<level>(``) are never mutated
(``do_not_mutate_patterns`` in the generated mutmut config).

Usage (from scripts/mutation.sh): ``python scripts/mutation_ops.py run`` in a prepared copy.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable

import libcst as cst
from mutmut.mutation import mutators

_REMOVABLE = (cst.Expr, cst.Assign, cst.AnnAssign, cst.AugAssign, cst.Return, cst.Raise,
              cst.Del, cst.Break, cst.Continue)


def operator_remove_statement(node: cst.SimpleStatementLine) -> Iterable[cst.CSTNode]:
    """Statement removal: replace a one-statement line by ``pass`` (never a docstring)."""
    if len(node.body) != 1 or not isinstance(node.body[0], _REMOVABLE):
        return
    stmt = node.body[0]
    if isinstance(stmt, cst.Expr) and isinstance(stmt.value, cst.BaseString | cst.Ellipsis):
        return  # NOTE: a docstring or ``...`` body: removing it changes nothing observable
    if isinstance(stmt, cst.AnnAssign) and stmt.value is None:
        return  # NOTE: a bare annotation declares nothing at run time
    yield node.with_changes(body=[cst.Pass()])


OPERATORS: mutators.OPERATORS_TYPE = [
    (cst.BaseNumber, mutators.operator_number),
    (cst.Name, mutators.operator_name),
    (cst.AugAssign, mutators.operator_augmented_assignment),
    (cst.UnaryOperation, mutators.operator_remove_unary_ops),
    (cst.CSTNode, mutators.operator_keywords),
    (cst.CSTNode, mutators.operator_swap_op),
    (cst.SimpleStatementLine, operator_remove_statement),
]


def main() -> None:
    # NOTE: in place, because mutmut's file_mutation module imported the same list object.
    mutators.mutation_operators[:] = OPERATORS
    from mutmut.__main__ import cli

    sys.argv[0] = "mutmut"
    cli()


if __name__ == "__main__":
    main()

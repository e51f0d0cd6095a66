#!/usr/bin/env python3
"""The import-cycle check on small crates written for the purpose: each case is a cycle the
check must report or a layout it must leave alone.

Run: python3 tools/dev/test_import_cycles.py   (also run by `make import-cycles`)
"""

import importlib.util
import os
import tempfile
import unittest

HERE = os.path.dirname(os.path.abspath(__file__))
SPEC = importlib.util.spec_from_file_location("import_cycles", os.path.join(HERE, "import-cycles.py"))
import_cycles = importlib.util.module_from_spec(SPEC)
SPEC.loader.exec_module(import_cycles)


def cycles_of(files):
    """The cycles the check finds in a crate made of `files` ({path under src: text})."""
    with tempfile.TemporaryDirectory() as root:
        for rel, text in files.items():
            path = os.path.join(root, "src", rel)
            os.makedirs(os.path.dirname(path), exist_ok=True)
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
        modules = import_cycles.crate_modules(os.path.join(root, "src"))
        aliases = import_cycles.reexports(modules[()], modules)
        scans = {m: import_cycles.scan_module(m, p, modules, aliases) for m, p in modules.items()}
        graph = {m: import_cycles.module_edges(m, scans) for m in modules}
        comps = import_cycles.strongly_connected(graph)
        return sorted(sorted(import_cycles.name(m) for m in c) for c in comps if len(c) > 1)


class GlobImports(unittest.TestCase):
    def test_a_name_brought_by_a_parent_glob_is_an_edge_to_its_module(self):
        # b says Cell, which `use super::*` brings from lib.rs's `use c::Cell`; c uses b.
        found = cycles_of({
            "lib.rs": "mod b;\nmod c;\nuse c::Cell;\n",
            "b.rs": "use super::*;\npub struct Wall(pub Cell);\n",
            "c.rs": "pub struct Cell;\nfn f(_: crate::b::Wall) {}\n",
        })
        self.assertEqual(found, [["b", "c"]])

    def test_a_module_brought_by_a_glob_is_an_edge_where_it_heads_a_path(self):
        found = cycles_of({
            "lib.rs": "mod b;\nmod c;\n",
            "b.rs": "use super::*;\nfn f(_: c::Cell) {}\npub struct Wall;\n",
            "c.rs": "pub struct Cell;\nfn f(_: crate::b::Wall) {}\n",
        })
        self.assertEqual(found, [["b", "c"]])

    def test_a_glob_of_a_sibling_is_an_edge_to_it(self):
        found = cycles_of({
            "lib.rs": "mod b;\nmod c;\n",
            "b.rs": "use crate::c::*;\npub struct Wall;\n",
            "c.rs": "pub struct Cell;\nfn f(_: crate::b::Wall) {}\n",
        })
        self.assertEqual(found, [["b", "c"]])

    def test_a_local_variable_or_field_named_like_a_glob_name_is_no_edge(self):
        found = cycles_of({
            "lib.rs": "mod b;\nmod c;\nuse c::cell;\n",
            "b.rs": "use super::*;\npub struct Wall { cell: u8 }\n"
                    "fn f(w: Wall) -> u8 { let c = w.cell; c }\n",
            "c.rs": "pub fn cell() {}\nfn f(_: crate::b::Wall) {}\n",
        })
        self.assertEqual(found, [])

    def test_a_child_using_its_parent_is_no_cycle(self):
        found = cycles_of({
            "lib.rs": "mod b;\npub struct Core;\nfn f(_: b::Wall) {}\n",
            "b.rs": "use super::*;\npub struct Wall(Core);\n",
        })
        self.assertEqual(found, [])

    def test_a_module_whose_name_begins_with_as_is_seen(self):
        found = cycles_of({
            "lib.rs": "mod assign;\nmod b;\n",
            "assign.rs": "use crate::b::Wall;\npub struct Cell;\n",
            "b.rs": "use crate::assign::Cell;\npub struct Wall;\n",
        })
        self.assertEqual(found, [["assign", "b"]])


if __name__ == "__main__":
    unittest.main()

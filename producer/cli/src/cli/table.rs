//! Plain text tables for humans (`--json` is for programs): columns sized to their content,
//! no borders, numbers aligned right.

use comfy_table::{CellAlignment, ContentArrangement, Table, presets};

/// A table with these headers; columns named in `right` are right-aligned.
pub fn new<const N: usize>(header: [&str; N], right: &[&str]) -> Table {
    let mut t = Table::new();
    t.load_style(presets::NOTHING).set_content_arrangement(ContentArrangement::Disabled).set_header(header);
    for (i, name) in header.iter().enumerate() {
        if right.contains(name)
            && let Some(c) = t.column_mut(i)
        {
            c.set_cell_alignment(CellAlignment::Right);
        }
    }
    t
}

/// Prints the table with the outer padding trimmed, so lines start at column 0. Cells may
/// hold text from the wire or from Redis: control characters are printed escaped, so no cell
/// can drive the terminal.
pub fn print(t: &Table) {
    for line in t.lines() {
        let line = chime_shared::redact::escape_control(&line).into_owned();
        println!("{}", line.strip_prefix(' ').unwrap_or(&line).trim_end());
    }
}

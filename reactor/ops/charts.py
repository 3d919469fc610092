"""The dashboard's charts: server-side SVG drawn by pygal, inlined into the page.

SVG made on the server needs no script and no asset from anywhere (the page works offline
and under a policy that forbids scripts), and it is plain markup a browser test can read.
pygal puts a configuration `<script>` into every chart for its optional interactive layer; we
drop it, and labels are escaped by the XML serializer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from xml.etree import ElementTree

import pygal
from pygal.style import Style

__all__ = ["per_minute_chart"]

_SVG = "{http://www.w3.org/2000/svg}"

_STYLE = Style(
    background="transparent",
    plot_background="transparent",
    foreground="#333",
    foreground_strong="#111",
    foreground_subtle="#999",
    font_family="system-ui, sans-serif",
    colors=("#3b7dd8", "#e0a030", "#4caf50", "#d9534f", "#8e6bbf", "#2bb3b3", "#999999"),
)


def per_minute_chart(
    title: str, minutes: Sequence[str], series: Mapping[str, Sequence[int]], *, stacked: bool
) -> str:
    """An SVG bar chart of per-minute counts (one bar per minute, a series per key).

    `minutes` are ISO timestamps; every tenth one is labelled HH:MM.
    """
    kind = pygal.StackedBar if stacked else pygal.Bar
    chart = kind(
        style=_STYLE,
        width=720,
        height=260,
        js=[],
        title=title,
        show_minor_x_labels=False,
        x_label_rotation=0,
        legend_box_size=10,
        truncate_label=-1,
        truncate_legend=-1,
        print_values=False,
        margin=8,
        spacing=4,
        no_data_text="no rows finished in the last hour",
    )
    chart.x_labels = [m[11:16] for m in minutes]
    chart.x_labels_major = [m[11:16] for i, m in enumerate(minutes) if i % 10 == 0]
    for name, values in series.items():
        chart.add(name, list(values))
    tree = chart.render_tree()
    for parent in list(tree.iter()):
        for child in list(parent):
            if child.tag in (f"{_SVG}script", "script"):
                parent.remove(child)
    return ElementTree.tostring(tree, encoding="unicode")

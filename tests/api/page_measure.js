// Test helper, never served by the product: tests/api/test_page.py serves the real page with this script added,
// then reads what it measured from the DOM Chromium dumps. Every 250 ms it records, in <pre id="page-measure">,
// the sizes a DOM dump cannot show: the page's and each panel's scroll width, the rendered size of every chart
// text (its font size times the scale of the SVG it is drawn in), each chart's box, where each arm's points and
// lines are drawn, which alert rows are on screen and how a row of each state looks.
"use strict";

(() => {
  const round = (n) => Math.round(n * 100) / 100;

  function box(node) {
    const r = node.getBoundingClientRect();
    const [left, top] = [round(r.left + scrollX), round(r.top + scrollY)];
    return { left, top, width: round(r.width), height: round(r.height) };
  }

  /** The size a text is drawn at, in CSS px: its font size, scaled by every transform and viewBox above it. */
  function renderedPx(text) {
    const matrix = text.getScreenCTM();
    const scale = matrix ? Math.hypot(matrix.a, matrix.b) : 1;
    return round(parseFloat(getComputedStyle(text).fontSize) * scale);
  }

  function visible(node) {
    const style = getComputedStyle(node);
    return node.getClientRects().length > 0 && style.visibility !== "hidden" && style.display !== "none";
  }

  function measure() {
    const doc = document.documentElement;
    const out = {
      inner_width: innerWidth,
      client_width: doc.clientWidth,
      scroll_width: doc.scrollWidth,
      charts: {},
      chart_texts: [],
      html_texts_min_px: null,
      arms: {},
      ideal: [],
    };
    for (const id of ["ab-chart", "bytes-chart"]) {
      const holder = document.getElementById(id);
      if (!holder) continue;
      out.charts[id] = { box: box(holder), svgs: [...holder.querySelectorAll("svg")].map(box) };
      for (const text of holder.querySelectorAll("svg text")) {
        if (!visible(text) || !text.textContent.trim()) continue;
        out.chart_texts.push({ chart: id, text: text.textContent.slice(0, 60), px: renderedPx(text) });
      }
    }
    // panels whose content is wider than they are (it overflows them, or would need a scrollbar)
    out.panels_overflowing = [...document.querySelectorAll(".panel")]
      .filter((panel) => visible(panel) && panel.scrollWidth > panel.clientWidth + 1)
      .map((panel) => `${panel.id}: ${panel.scrollWidth} > ${panel.clientWidth}`);
    // the smallest font of the HTML text the detail panel shows (legends, cards, verdicts)
    const detail = document.getElementById("ab-detail");
    if (detail) {
      for (const node of detail.querySelectorAll("*")) {
        if (node instanceof SVGElement || !visible(node)) continue;
        if (![...node.childNodes].some((c) => c.nodeType === Node.TEXT_NODE && c.textContent.trim())) continue;
        const px = parseFloat(getComputedStyle(node).fontSize);
        if (out.html_texts_min_px === null || px < out.html_texts_min_px) out.html_texts_min_px = px;
      }
    }
    // each arm's line colour and the centre of each of its points, in page px, in drawing order
    const chart = document.querySelector("#ab-chart svg");
    if (chart) {
      for (const group of chart.querySelectorAll("g.arm[data-arm]")) {
        const name = group.getAttribute("data-arm");
        const line = group.querySelector(".hit-line");
        const own = [...chart.querySelectorAll(".arm-points")].find((g) => g.getAttribute("data-arm") === name);
        const points = [...(own || group).querySelectorAll(".point")].map((p, i) => {
          const b = box(p);
          const r = Number(p.getAttribute("data-round")) || i + 1;
          return { round: r, x: round(b.left + b.width / 2), y: round(b.top + b.height / 2) };
        });
        out.arms[name] = {
          stroke: line ? getComputedStyle(line).stroke : null,
          stroke_width: line ? parseFloat(getComputedStyle(line).strokeWidth) : null,
          points,
        };
      }
      for (const line of chart.querySelectorAll(".ideal-line")) {
        const matrix = line.getScreenCTM();
        const width = parseFloat(getComputedStyle(line).strokeWidth) * (matrix ? Math.hypot(matrix.a, matrix.b) : 1);
        out.ideal.push({ stroke: getComputedStyle(line).stroke, rendered_width: round(width), box: box(line) });
      }
    }
    // the alert rows on screen (not in a closed group), and how a row of each state looks
    const rows = [...document.querySelectorAll("#alerts-body tr.alert")];
    out.alert_rows_visible = rows.filter((row) => row.checkVisibility()).length; // not in a closed <details>
    out.alert_row_styles = {};
    for (const state of ["firing", "pending", "resolved"]) {
      const row = rows.find((r) => r.classList.contains(state));
      if (!row) continue;
      const style = getComputedStyle(row);
      const first = getComputedStyle(row.cells[0]);
      out.alert_row_styles[state] = [style.color, style.opacity, style.backgroundColor, first.boxShadow].join(" | ");
    }
    let node = document.getElementById("page-measure");
    if (!node) {
      node = document.createElement("pre");
      node.id = "page-measure";
      node.hidden = true;
      document.body.append(node);
    }
    node.textContent = JSON.stringify(out);
  }

  setInterval(measure, 250);
})();

// Draws every sparkline (svg.sparkline[data-values]) on load and after each htmx swap.
(function () {
  "use strict";
  function draw(root) {
    var lib = window.sparkline;
    var fn = lib && (lib.sparkline || lib.default || lib);
    if (typeof fn !== "function") { return; }
    root.querySelectorAll("svg.sparkline[data-values]").forEach(function (svg) {
      var values = (svg.getAttribute("data-values") || "").split(",").filter(function (v) { return v !== ""; }).map(Number);
      if (values.length < 2) { values = [0, 0].concat(values); }
      if (Math.max.apply(Math, values) > 0) { fn(svg, values); return; }
      // The library scales by the largest value: an idle consumer gets a flat line of its own.
      var line = document.createElementNS("http://www.w3.org/2000/svg", "path");
      var y = parseFloat(svg.getAttribute("height")) - 1;
      line.setAttribute("class", "sparkline--line");
      line.setAttribute("d", "M0 " + y + " L" + svg.getAttribute("width") + " " + y);
      svg.replaceChildren(line);
    });
  }
  document.addEventListener("DOMContentLoaded", function () { draw(document); });
  document.addEventListener("htmx:afterSwap", function (event) { draw(event.target); });
})();

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
      fn(svg, values);
    });
  }
  document.addEventListener("DOMContentLoaded", function () { draw(document); });
  document.addEventListener("htmx:afterSwap", function (event) { draw(event.target); });
})();

// Long dotted names in the side navigation and in page titles (API pages are named after
// their module) may break after a dot, as a person would break them, and nowhere else.
document.addEventListener("DOMContentLoaded", () => {
  document.querySelectorAll("nav.bd-links a, article.bd-article h1").forEach((link) => {
    const walker = document.createTreeWalker(link, NodeFilter.SHOW_TEXT);
    const texts = [];
    while (walker.nextNode()) texts.push(walker.currentNode);
    texts.forEach((node) => {
      if (!/\w\.\w/.test(node.nodeValue)) return;
      const pieces = node.nodeValue.split(/(?<=\.)/);
      const fragment = document.createDocumentFragment();
      pieces.forEach((piece, i) => {
        if (i > 0) fragment.appendChild(document.createElement("wbr"));
        fragment.appendChild(document.createTextNode(piece));
      });
      node.replaceWith(fragment);
    });
  });
});

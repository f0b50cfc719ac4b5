// Building the page: every server string reaches it as a text node or an attribute value set by
// setAttribute, never as markup: the console parses no HTML from a string anywhere.

const SVG_NS = "http://www.w3.org/2000/svg";

function fill(element, attrs, children) {
  for (const [name, value] of Object.entries(attrs || {})) {
    if (value === null || value === undefined || value === false) continue;
    if (name.startsWith("on") && typeof value === "function") {
      element.addEventListener(name.slice(2), value);
    } else if (value === true) {
      element.setAttribute(name, "");
    } else {
      element.setAttribute(name, String(value));
    }
  }
  for (const child of children.flat(Infinity)) {
    if (child === null || child === undefined || child === false) continue;
    element.append(child instanceof Node ? child : String(child)); // a string is appended as text
  }
  return element;
}

/** An HTML element: h("td", {class: "num"}, "12", h("span", {}, "tokens")). */
export function h(tag, attrs = {}, ...children) {
  return fill(document.createElement(tag), attrs, children);
}

/** An SVG element, built the same way. */
export function s(tag, attrs = {}, ...children) {
  return fill(document.createElementNS(SVG_NS, tag), attrs, children);
}

/** Replace what ``element`` holds with ``children``. */
export function put(element, ...children) {
  element.replaceChildren();
  return fill(element, {}, children);
}
